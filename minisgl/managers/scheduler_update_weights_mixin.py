"""The Scheduler's weight updates (stage 3, SGLang's scheduler_update_weights_mixin.py).

Where it sits: Scheduler.process_input_requests -> update_weights_from_disk /
update_weights_from_tensor / get_weights_by_name -> ModelRunner (the model's side,
models/weight_update.py) -> a reply for the TokenizerManager (or the Engine).
In: UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput, GetWeightsByNameReqInput.
Out: their *Output replies. Owns: the updates held until the requests in flight finish.

SGLang's order: the worker loads the weights, then the scheduler flushes the radix cache, whose
K/V the old weights computed. SGLang's TokenizerManager sends an update only once no request is
in flight (its model_update_lock), so its flush always succeeds. Here too; and an update that
still finds requests (one whose client left and whose abort has not run yet) is held, as a LoRA
unload is: those requests finish with the old weights, then the update runs at the end of the
step that left the scheduler idle. No request ever runs over K/V of two sets of weights.
With --tp-size N every rank gets the message and runs it at the same step (lockstep); the ranks
agree that each staged its slice before any changes (ModelRunner._update_weights).
"""

from __future__ import annotations

import logging
from typing import Any, List, Union

from minisgl.managers.io_struct import (
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
)
from minisgl.models.weight_update import deserialize_named_tensors

logger = logging.getLogger("minisgl.scheduler")

WeightUpdate = Union[UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput]
WeightUpdateOutput = Union[UpdateWeightFromDiskReqOutput, UpdateWeightsFromTensorReqOutput]


class SchedulerUpdateWeightsMixin:
    """Uses the Scheduler's model_runner, is_idle, flush_cache, _control_replies, and its
    pending_weight_updates (the held updates, in the order they came)."""

    model_runner: Any
    pending_weight_updates: List[WeightUpdate]
    _control_replies: List[Any]

    def update_weights(self, recv_req: WeightUpdate) -> Union[WeightUpdateOutput, None]:
        """Run an update now when nothing is in flight, else hold it (None: answered by the step
        that finishes the last request, through pop_control_replies)."""
        if self.pending_weight_updates or not self.is_idle():
            logger.info("Weight update waits for the requests in flight to finish")
            self.pending_weight_updates.append(recv_req)
            return None
        return self._run_weight_update(recv_req)

    def finish_weight_updates(self) -> None:
        """Each step's end: once idle, the held updates run, in the order they came."""
        while self.pending_weight_updates and self.is_idle():
            self._control_replies.append(self._run_weight_update(self.pending_weight_updates.pop(0)))

    def _run_weight_update(self, recv_req: WeightUpdate) -> WeightUpdateOutput:
        if isinstance(recv_req, UpdateWeightFromDiskReqInput):
            return self.update_weights_from_disk(recv_req)
        return self.update_weights_from_tensor(recv_req)

    def update_weights_from_disk(self, recv_req: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        """SGLang's: the worker's update, then a flush of the radix cache (its K/V are the old weights')."""
        success, message = self.model_runner.update_weights_from_disk(recv_req.model_path, recv_req.load_format)
        if success:
            self._flush_after_update()
        else:
            logger.error(message)
        return UpdateWeightFromDiskReqOutput(success, message, 0)

    def update_weights_from_tensor(self, recv_req: UpdateWeightsFromTensorReqInput) -> UpdateWeightsFromTensorReqOutput:
        """SGLang's: the worker's update, then the flush unless the caller keeps the cache (flush_cache false)."""
        # the Engine's own tensors (in its process), else the files' bytes, read as staging goes
        named_tensors = recv_req.named_tensors
        if named_tensors is None:
            named_tensors = deserialize_named_tensors(recv_req.serialized_named_tensors)
        success, message = self.model_runner.update_weights_from_tensor(named_tensors, recv_req.load_format)
        if success and recv_req.flush_cache:
            self._flush_after_update()
        elif not success:
            logger.error(message)
        return UpdateWeightsFromTensorReqOutput(success, message)

    def _flush_after_update(self) -> None:
        out = self.flush_cache()
        # (an update runs only when idle, the one time a flush always succeeds: SGLang asserts it too)
        assert out.success, f"Cache flush failed after updating weights: {out.message}"

    def get_weights_by_name(self, recv_req: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        """SGLang's: the parameter's first rows, or None with the reason (an unknown name, a bad size)."""
        truncate_size = recv_req.truncate_size
        if type(truncate_size) is not int or truncate_size < 0:
            return GetWeightsByNameReqOutput(None, f"truncate_size must be an integer >= 0, got {truncate_size!r}")
        try:
            return GetWeightsByNameReqOutput(self.model_runner.get_weights_by_name(recv_req.name, truncate_size))
        except ValueError as e:
            return GetWeightsByNameReqOutput(None, str(e))
        except Exception as e:  # a read changes nothing: a bug here answers this request, never ends the server
            logger.exception("get_weights_by_name(%r) failed", recv_req.name)
            return GetWeightsByNameReqOutput(None, f"get_weights_by_name({recv_req.name!r}) failed: {type(e).__name__}: {e}")
