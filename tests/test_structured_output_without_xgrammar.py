"""Without xgrammar (the `grammar` extra not installed), minisgl imports, serves plain requests,
and answers a structured-output request with a 400 that says what to install. Run in a fresh
interpreter where `import xgrammar` fails, so no earlier import can hide a top-level one."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
sys.modules["xgrammar"] = None  # import xgrammar raises ImportError
import minisgl.entrypoints.http_server  # the server's modules import without it
from minisgl import Engine
with Engine(sys.argv[1], device="cpu", max_total_tokens=512) as e:
    try:
        e.generate("a", {"regex": "a+"})
        refused, param = "not refused", None
    except ValueError as err:
        refused, param = str(err), getattr(err, "param", None)
    rid = e.add_request("a", {"json_schema": '{"type": "object"}'})
    while e.has_unfinished_requests():
        e.step()
    reason = e.get_result(rid)["meta_info"]["finish_reason"]
    plain = e.generate("a", {"max_new_tokens": 2})["meta_info"]["finish_reason"]
print(json.dumps([refused, param, reason, plain, "xgrammar" in sys.modules and sys.modules["xgrammar"] is not None]))
"""


def test_without_xgrammar_plain_requests_run_and_grammars_are_a_400(tiny_model: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    refused, param, reason, plain, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert "needs xgrammar, which is not installed: pip install xgrammar" in refused
    # the refusal names the grammar's field: a ParamError from generate(), and minisgl's "param" key
    # in the abort's finish_reason (SGLang's has type, message, status_code, err_type only)
    assert param == "regex"
    assert reason["type"] == "abort" and reason["status_code"] == 400 and reason["param"] == "json_schema", reason
    assert plain["type"] == "length" and imported is False

