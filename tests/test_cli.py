"""`minisgl generate`: the first command a new user runs prints the Engine's completion."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from minisgl import Engine
from minisgl.cli import _build_parser
from minisgl.server_args import ServerArgs, resolve_server_args


def test_generate_prints_the_engines_greedy_completion(tiny_model: str) -> None:
    prompt = "The with statement"
    engine = Engine(tiny_model, device="cpu")
    expected = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0})["text"]
    engine.shutdown()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "generate", "--model", tiny_model, "--prompt", prompt, "--max-new-tokens", "6", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == expected + "\n"


def test_serve_help_lists_sglang_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in ("--model-path", "--page-size", "--chunked-prefill-size", "--enable-mixed-chunk", "--visualize", "--api-key"):
        assert flag in proc.stdout


def test_sglang_flags_for_what_minisgl_always_does_are_accepted_and_said(capsys: Any) -> None:
    """A launch line carried over from SGLang failed on "unrecognized arguments"."""
    from minisgl.cli import _say_sglang_flags

    parser, _ = _build_parser()
    args = parser.parse_args(["serve", "--enable-metrics", "--disable-overlap-schedule", "--page-size", "4"])
    assert ServerArgs.from_cli_args(args) == ServerArgs(page_size=4)
    _say_sglang_flags(args)
    said = capsys.readouterr().err
    assert "--enable-metrics: nothing to change, metrics are always on" in said
    assert "--disable-overlap-schedule: nothing to change" in said and "--enable-cache-report" not in said
    # --disable-cuda-graph is minisgl's own flag now (decode steps replay CUDA graphs on a GPU)
    assert ServerArgs.from_cli_args(parser.parse_args(["serve", "--disable-cuda-graph"])).disable_cuda_graph


def test_settings_that_cannot_work_are_one_line_errors_not_tracebacks() -> None:
    """Each of these used to start and then crash the scheduler (ZeroDivisionError, a watchdog
    ValueError after the model loaded) or print a traceback."""
    cases = [
        (["serve", "--decode-log-interval", "0"], "--decode-log-interval must be >= 1"),
        (["serve", "--watchdog-timeout", "0"], "--watchdog-timeout must be a number > 0"),
        (["serve", "--soft-watchdog-timeout", "-1"], "--soft-watchdog-timeout must be a number > 0"),
        (["serve", "--context-length", "-4"], "--context-length must be >= 1"),
        (["serve", "--page-size", "0"], "--page-size must be >= 1"),
        (["serve", "--port", "70000"], "--port must be in [0, 65535]"),
        (["serve", "--log-level", "verbose"], "--log-level must be one of debug, info"),
        (["serve", "--random-seed", str(2**64)], "--random-seed must be in [-2**63, 2**64)"),  # (the scheduler died)
        (["serve", "--model-path", "/no/such/dir"], "Model directory '/no/such/dir' does not exist"),  # (before any child)
        (["serve", "--tokenizer-path", "/no/such/tok"], "Tokenizer directory '/no/such/tok' does not exist"),  # (165 lines from two processes)
        (["serve", "--device", "cpu", "--attention-backend", "triton"], "--attention-backend triton needs a GPU"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (conftest sets it for the kernel tests)
    for argv, message in cases:
        proc = subprocess.run([sys.executable, "-m", "minisgl", *argv], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        assert message in proc.stderr and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])


def test_an_engine_grammar_backend_minisgl_does_not_have_is_refused() -> None:
    """SGLang's outlines / llguidance given to the Engine (argparse's choices only guard the CLI)."""
    for name in ("outlines", "off"):
        with pytest.raises(ValueError, match=f"--grammar-backend must be one of xgrammar, none, got '{name}'"):
            ServerArgs(grammar_backend=name)


def test_the_triton_backend_without_triton_installed_is_a_clear_refusal(monkeypatch: Any) -> None:
    # triton is no dependency of minisgl (~1 GB the CPU path never imports); CUDA torch brings it
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec("triton") is None: not installed
    with pytest.raises(ValueError, match="needs the triton package .* pip install triton"):
        resolve_server_args(ServerArgs(device="cpu", attention_backend="triton"))


def test_mixed_chunks_without_chunked_prefill_run_and_say_they_do_nothing(caplog: Any) -> None:
    """SGLang accepts the launch line and silently mixes nothing; minisgl runs it and says so."""
    import logging

    with caplog.at_level(logging.WARNING):
        resolve_server_args(ServerArgs(device="cpu", attention_backend="torch", enable_mixed_chunk=True, chunked_prefill_size=-1))
    assert any("--enable-mixed-chunk lets decoding requests ride" in r.getMessage() and "no effect" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_flags_a_cpu_run_does_not_use_are_said_at_start(caplog: Any, tiny_model: str) -> None:
    """Accepted and then unused, they were dropped without a word."""
    import logging

    from minisgl.managers.schedule_policy import SchedulePolicy

    with caplog.at_level(logging.WARNING):
        resolve_server_args(ServerArgs(device="cpu", attention_backend="torch", mem_fraction_static=0.3))
        resolve_server_args(ServerArgs(device="cpu", attention_backend="torch", cpu_kv_cache_gb=0.01, max_total_tokens=4000))
        resolve_server_args(ServerArgs(device="cpu", attention_backend="torch", max_total_tokens=4000))  # nothing to say

        class NoCache:
            disable = True

        assert SchedulePolicy("lpm", NoCache()).policy == "fcfs"
    said = [r.getMessage() for r in caplog.records]
    assert any("--mem-fraction-static sizes the KV pool on CUDA only" in m for m in said)
    assert sum("--cpu-kv-cache-gb is not used: --max-total-tokens 4000" in m for m in said) == 1
    assert any("--schedule-policy lpm orders by prefix-cache matches; with --disable-radix-cache it is fcfs" in m for m in said)


def test_the_engine_refuses_the_http_servers_options_and_applies_log_level(tiny_model: str, caplog: Any) -> None:
    import logging

    with pytest.raises(ValueError, match="api_key, visualize: option\\(s\\) of `minisgl serve`"):
        Engine(tiny_model, device="cpu", api_key="secret", visualize=True)
    minisgl_logger = logging.getLogger("minisgl")
    level = minisgl_logger.level
    try:
        with Engine(tiny_model, device="cpu", log_level="error", port=30000):  # (a default value is no option set)
            assert minisgl_logger.getEffectiveLevel() == logging.ERROR
    finally:
        minisgl_logger.setLevel(level)
    # an SGLang script's sgl.Engine(..., disable_overlap_schedule=True): taken and said, as by `serve`
    with caplog.at_level(logging.INFO, logger="minisgl"):
        with Engine(tiny_model, device="cpu", disable_overlap_schedule=True, enable_metrics=True) as engine:
            assert engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
    assert any("disable_overlap_schedule: nothing to change, minisgl's scheduler never overlaps" in r.getMessage() for r in caplog.records)


def test_log_level_takes_any_case_and_logging_aliases() -> None:
    from minisgl.server_args import ServerArgs

    for level in ("INFO", "warning", "warn", "Debug"):
        assert ServerArgs.from_argv(["--log-level", level]).log_level == level


def test_serve_with_a_model_it_cannot_find_fails_once_with_the_schedulers_message() -> None:
    """The HTTP process loaded its tokenizer before waiting for its children, so the user got its
    retries and its own message instead of the scheduler's clear one."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--model-path", "minisgl-test/no-such-model", "--port", "0"],
                          capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "minisgl server failed: minisgl-scheduler failed to start" in proc.stderr
    assert "Cannot find model 'minisgl-test/no-such-model'" in proc.stderr and "hf download" in proc.stderr
    assert "Cannot load the tokenizer" not in proc.stderr
    assert "Traceback" not in proc.stderr  # an expected refusal is one line per process, not a traceback


def test_serve_on_a_port_in_use_fails_before_loading_the_model(tiny_model: str) -> None:
    """The port was bound only after the model loaded (minutes for a real one), and the error
    named no port: "[Errno 98] Address already in use"."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        argv = [sys.executable, "-m", "minisgl", "serve", "--model-path", tiny_model, "--port", str(port)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; choose another --port" in proc.stderr
    assert "minisgl scheduler pid=" not in proc.stdout  # nothing was started


def test_a_checkout_run_in_place_finds_its_kernels_and_web_folders() -> None:
    # From the repo root after a plain `pip install .` the checkout's minisgl/ shadows the
    # installed copy, and no package-dir map says where minisgl.kernels / minisgl.web are:
    # `minisgl serve` died with "No module named 'minisgl.kernels'". `-S`: no site-packages,
    # so no editable-install finder either, only the checkout.
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import importlib.util as u, minisgl.web; "
            "print(u.find_spec('minisgl.kernels.cpu_build').origin); print(minisgl.web.__file__); "
            "print(*minisgl.__path__)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-S", "-c", code, repo], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [os.path.join(repo, "kernels", "cpu_build.py"), os.path.join(repo, "web", "__init__.py"),
                                   os.path.join(repo, "minisgl")]  # only those two names: no minisgl.minisgl.minisgl...


def test_the_builtin_model_is_served_as_minisgl_builtin_and_a_path_as_itself(tiny_model: str) -> None:
    """The name /v1/models lists and clients must send as `model`."""
    assert resolve_server_args(ServerArgs(device="cpu")).served_model_name == "minisgl-builtin"
    assert resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu")).served_model_name == tiny_model


def test_generate_defaults_to_32_greedy_tokens() -> None:
    """What `minisgl generate --help` promises: 32 tokens, temperature 0."""
    _, commands = _build_parser()
    args = commands["generate"].parse_args(["--prompt", "hi"])
    assert (args.max_new_tokens, args.temperature) == (32, 0.0)


# --------------------------------------------------------------------------- laptops and their terminals
def test_a_model_folder_without_tokenizer_files_is_refused(tiny_model: str, tmp_path: Any) -> None:
    """transformers 5 builds a one-token tokenizer from a config.json alone: the server started,
    and every text prompt was then a 400 "The prompt is empty"."""
    import shutil

    from minisgl.utils import get_tokenizer

    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_model, name), tmp_path / name)
    with pytest.raises(ValueError, match="No tokenizer in .* pass --tokenizer-path"):
        get_tokenizer(str(tmp_path))
    assert len(get_tokenizer(tiny_model)) > 1


def test_the_cpu_backend_asked_for_where_its_kernels_cannot_build_is_refused_at_once(monkeypatch: Any, tmp_path: Any) -> None:
    """It was refused only in the scheduler, after the model loaded, as a traceback."""
    from minisgl.kernels import cpu_build

    monkeypatch.setenv("CC", "/no/such/cc")
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))  # nothing built yet
    cpu_build.load_cpu_library.cache_clear()
    try:
        with pytest.raises(ValueError, match="--attention-backend cpu needs minisgl's C kernels"):
            resolve_server_args(ServerArgs(device="cpu", attention_backend="cpu"))
        assert resolve_server_args(ServerArgs(device="cpu")).attention_backend == "torch"  # auto falls back
        monkeypatch.setenv("CC", '"/usr/bin/gcc')  # a quote left open: a message, not "No closing quotation"
        with pytest.raises(cpu_build.CpuKernelUnavailable, match="cannot be read as a command"):
            cpu_build.find_compiler()
    finally:
        cpu_build.load_cpu_library.cache_clear()


def test_a_tmpdir_too_long_for_a_socket_path_is_named(tmp_path: Any, monkeypatch: Any) -> None:
    """An 87-character TMPDIR (CI sandboxes, HPC job folders) failed in both children after the
    model loaded, as two ZMQError tracebacks."""
    from minisgl.server_args import PortArgs

    long_dir = tmp_path / ("d" * (110 - len(str(tmp_path))))
    long_dir.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_dir))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (it caches TMPDIR on first use)
    with pytest.raises(ValueError, match="set TMPDIR to a shorter folder"):
        PortArgs.init_new()
    assert os.listdir(long_dir) == []  # its folder is not left behind
    proc = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--port", "0"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(long_dir)})  # fmt: skip
    assert proc.returncode == 1 and "set TMPDIR to a shorter folder" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "minisgl scheduler pid=" not in proc.stdout


@pytest.mark.parametrize(
    "host, message",
    [("no.such.host.invalid", "cannot resolve --host no.such.host.invalid"),
     ("192.0.2.1", "--host must be an address of this machine")],  # (TEST-NET-1: never this machine's)
)  # fmt: skip
def test_an_unknown_host_is_named_as_the_host(tiny_model: str, host: str, message: str) -> None:
    argv = [sys.executable, "-m", "minisgl", "serve", "--model-path", tiny_model, "--host", host]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr[-2000:]
    assert "--port" not in proc.stderr  # (it said "choose another --port")


@pytest.mark.parametrize("nohup", [False, True])
def test_closing_the_terminal_shuts_the_server_down_cleanly(tiny_model: str, tmp_path: Any, nohup: bool) -> None:
    """SIGHUP killed the HTTP process with no cleanup: its socket folder stayed in TMPDIR, and the
    children died on their own. Under nohup (SIGHUP ignored) the server outlives its terminal."""
    import signal
    import time
    import urllib.request

    from minisgl.utils import free_port

    def healthy() -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200
        except OSError:
            return False

    port = free_port()
    argv = [sys.executable, "-m", "minisgl", "serve", "--model-path", tiny_model, "--port", str(port)]
    ignore_hup = (lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if nohup else None
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)}, preexec_fn=ignore_hup)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not healthy() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.25)
        os.killpg(proc.pid, signal.SIGHUP)  # what a closing terminal sends its foreground job
        if nohup:
            time.sleep(1.5)
            assert proc.poll() is None and healthy(), "a server started under nohup stopped on SIGHUP"
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # (say how far the shutdown got: its log, not only a timeout)
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the server did not exit within 30 s of the signal; its output:\n{proc.communicate()[0][-3000:]}")
    finally:  # a failed assertion above must not leave the server (and its children) running for hours
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-2000:]
    assert "Shutdown requested" in out and "died" not in out, out[-2000:]
    assert [p for p in os.listdir(tmp_path) if p.startswith("minisgl-")] == []


def test_ctrl_c_in_generate_ends_without_a_traceback(monkeypatch: Any, capsys: Any) -> None:
    from minisgl import cli

    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", interrupted)
    assert cli.main(["generate", "--prompt", "hello"]) == 130


@pytest.mark.parametrize("arming", ["prctl", "polling"])
def test_a_child_whose_parent_died_while_it_started_exits(tmp_path: Any, arming: str) -> None:
    """PR_SET_PDEATHSIG is armed only once a child has imported torch: a server killed (-9) in
    those seconds left its scheduler loading the model for minutes, parentless. (Where there is
    no prctl, the child polls its parent's pid, which must not be the adopter's from the start.)"""
    import time

    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, os, time

        def child():
            time.sleep(1.5)  # (importing torch and the scheduler module)
            if {arming == "polling"}:  # as on macOS: no libc.so.6
                import ctypes
                def no_libc(*args, **kwargs):
                    raise OSError("no libc.so.6 here")
                ctypes.CDLL = no_libc
            from minisgl.utils import kill_itself_when_parent_died
            kill_itself_when_parent_died()
            open({str(tmp_path / "survived")!r}, "w").close()

        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=child)
            p.start()
            print(p.pid, flush=True)
            time.sleep(0.5)
            os._exit(0)  # as a SIGKILL: no cleanup, no join
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60).stdout
    child = int(out.split()[0])
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (tmp_path / "survived").exists(), "the orphan went on past kill_itself_when_parent_died"


def test_chat_template_flag_is_checked_at_start(tmp_path: Any) -> None:
    """--chat-template takes a Jinja file; a missing file, SGLang's JSON templates and a syntax
    error fail the start with a message naming the flag, never each chat request later."""
    from minisgl.chat_template import load_chat_template

    with pytest.raises(ValueError, match="--chat-template chatml: no such file"):
        ServerArgs(model_path="m", chat_template="chatml")
    as_json = tmp_path / "t.json"
    as_json.write_text("{}")
    with pytest.raises(ValueError, match="JSON conversation templates"):
        ServerArgs(model_path="m", chat_template=str(as_json))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ValueError, match=r"broken.jinja: line 1: .*endfor"):
        ServerArgs(model_path="m", chat_template=str(broken))
    good = tmp_path / "good.jinja"  # with what transformers adds to Jinja: {% break %}, {% generation %}
    good.write_text("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% break %}{% endfor %}")
    assert ServerArgs(model_path="m", chat_template=str(good)).chat_template == str(good)

    class Tok:
        chat_template = None

    tok = Tok()
    load_chat_template(tok, str(good))
    assert tok.chat_template == good.read_text()
    with pytest.raises(ValueError, match="chat_template: option"):  # the Engine has no chat route to render for
        Engine(device="cpu", chat_template=str(good))
