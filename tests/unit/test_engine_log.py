"""The root cause of a failed engine start, found in vLLM 0.32 server logs (no vLLM needed).

The excerpts are written the way vLLM 0.32 prints them: every line of a logged record repeats the
``(EngineCore_DP0 pid=N) LEVEL date [file:line] `` prefix (lines joined by CRLF), the engine core
process's uncaught exception is printed again by multiprocessing without a prefix, and the API
server ends the log with its own traceback ("Engine core initialization failed. See root cause
above.").
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

import turbowire.connector as connector_pkg
import turbowire.serving.launch as launch
from turbowire.engine_log import find_root_cause, log_tail, read_root_cause, strip_ansi

SITE = "/opt/venv/lib/python3.11/site-packages"
CPU_CACHE = f"{SITE}/turbowire/connector/cpu_cache.py"
LAYOUT_MSG = (
    "vLLM CPU attention (isa amx) stores KV in a layout turbowire does not know; "
    "run with VLLM_CPU_ATTN_ISA=vec or report the vLLM version"
)
LAYOUT_LINE = f"turbowire.connector.cpu_cache.CpuCacheLayoutError: {LAYOUT_MSG}"
BLOCK_LINE = (
    "ValueError: No common block size for 16 (CPU_ATTN: [32, 64, 128]; "
    "TurboWireCPU: [32])."
)
WRAPPER_LINE = (
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore_DP0': 1}"
)


def record(proc: str, level: str, where: str, *lines: str, time: str = "12-01 10:00:05") -> str:
    """One vLLM log record: the prefix repeated on every line, CRLF inside the record."""
    prefix = f"({proc}) {level} {time} [{where}] "
    return "\r\n".join(prefix + line for line in lines) + "\n"


def core_frames(raise_file: str, raise_line: str) -> list[str]:
    return [
        "Traceback (most recent call last):",
        f'  File "{SITE}/vllm/v1/engine/core.py", line 1480, in run_engine_core',
        "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)",
        "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        f'  File "{SITE}/vllm/v1/engine/core.py", line 1165, in __init__',
        "    super().__init__(",
        f'  File "{SITE}/vllm/v1/engine/core.py", line 140, in __init__',
        "    num_gpu_blocks, num_cpu_blocks, kv_cache_config = self._initialize_kv_caches(",
        f'  File "{SITE}/vllm/v1/worker/gpu_model_runner.py", line 6100, in initialize_kv_cache',
        "    self.maybe_add_kv_connector_group(kv_cache_config)",
        f'  File "{raise_file}", line 120, in register_kv_caches',
        f"    {raise_line}",
    ]


def api_server_tail() -> str:
    """The API server's own end of the log: unlogged traceback ending in vLLM's wrapper."""
    return "\n".join([
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        f'  File "{SITE}/vllm/entrypoints/openai/api_server.py", line 900, in <module>',
        "    uvloop.run(run_server(args))",
        f'  File "{SITE}/vllm/v1/engine/utils.py", line 1432, in wait_for_engine_startup',
        "    raise RuntimeError(",
        WRAPPER_LINE,
        "",
    ])


def startup_head() -> str:
    return (
        record("APIServer pid=1200", "INFO", "api_server.py:1850",
               "vLLM API server version 0.32.0", time="12-01 10:00:00")
        + record("APIServer pid=1200", "INFO", "utils.py:330", "non-default args: {'model': "
                 "'/models/SmolLM2-135M-Instruct', 'block_size': 32}", time="12-01 10:00:00")
        + record("EngineCore_DP0 pid=1234", "INFO", "core.py:95",
                 "Initializing a V1 LLM engine (v0.32.0) with config: model='SmolLM2'",
                 time="12-01 10:00:03")
        + record("EngineCore_DP0 pid=1234", "WARNING", "cpu.py:400",
                 "Pin memory is not supported on CPU.", time="12-01 10:00:03")
    )


def failed_log(exc_lines: list[str], raise_file: str, raise_line: str) -> str:
    """A whole failed start: logged traceback, multiprocessing's copy, the API server's."""
    frames = core_frames(raise_file, raise_line)
    logged = record("EngineCore_DP0 pid=1234", "ERROR", "core.py:1510",
                    "EngineCore failed to start.", *frames, *exc_lines)
    raw = "\n".join(["Process EngineCore_DP0:", frames[0],
                     '  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, '
                     "in _bootstrap", "    self.run()", *frames[1:], *exc_lines]) + "\n"
    return startup_head() + logged + raw + api_server_tail()


def layout_log() -> str:
    return failed_log([LAYOUT_LINE], CPU_CACHE, "raise CpuCacheLayoutError(msg)")


def test_turbowire_cause_is_found() -> None:
    assert find_root_cause(layout_log()) == LAYOUT_LINE


def test_old_style_process_prefix_without_record_header() -> None:
    """The brief's shape: ``(EngineCore_DP0 pid=1234) Traceback ...`` (a tagged stderr)."""
    tag = "(EngineCore_DP0 pid=1234) "
    lines = [
        f"{tag}ERROR 12-01 10:00:00 [core.py:700] EngineCore failed to start.",
        *(tag + ln for ln in core_frames(CPU_CACHE, "raise CpuCacheLayoutError(msg)")),
        tag + LAYOUT_LINE,
        "(APIServer pid=1200) " + api_server_tail().replace("\n", "\n(APIServer pid=1200) "),
    ]
    assert find_root_cause("\n".join(lines)) == LAYOUT_LINE


def test_non_turbowire_cause_is_found() -> None:
    log = failed_log([BLOCK_LINE], f"{SITE}/vllm/v1/worker/utils.py", "raise ValueError(")
    assert find_root_cause(log) == BLOCK_LINE


def test_exception_raised_in_a_turbowire_frame_wins_over_the_chain_root() -> None:
    """A plain RuntimeError raised in a turbowire file (found by its source folder, as in an
    editable install) beats the ImportError it wraps, which Python prints first."""
    worker = str(Path(connector_pkg.__file__).parent / "worker.py")
    frames = core_frames(f"{SITE}/nixl/_api.py", "import nixl_cu12")
    ours = core_frames(worker, "raise RuntimeError(...) from exc")
    lines = [*frames, "ImportError: libcuda.so.1: cannot open shared object file", "",
             "The above exception was the direct cause of the following exception:", "",
             *ours, "RuntimeError: NIXL UCX backend unavailable; install nixl-cu12 or set "
             "nixl_backends"]
    log = startup_head() + record("EngineCore_DP0 pid=1234", "ERROR", "core.py:1510",
                                  "EngineCore failed to start.", *lines) + api_server_tail()
    cause = find_root_cause(log)
    assert cause is not None and cause.startswith("RuntimeError: NIXL UCX backend unavailable")


def test_chained_cause_first_exception_is_the_innermost() -> None:
    frames = core_frames(f"{SITE}/vllm/v1/worker/utils.py", "raise ValueError(")
    lines = [*frames, BLOCK_LINE, "", "During handling of the above exception, another "
             "exception occurred:", "", *frames, "KeyError: 'kv_cache_groups'"]
    log = record("EngineCore_DP0 pid=1234", "ERROR", "core.py:1510",
                 "EngineCore failed to start.", *lines) + api_server_tail()
    assert find_root_cause(log) == BLOCK_LINE


@pytest.mark.parametrize("wrapper", [
    WRAPPER_LINE,
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {}",
    "Exception: WorkerProc initialization failed due to an exception in a background process. "
    "See stack trace for root cause.",
    "SystemExit: 1",
    "KeyboardInterrupt",
])
def test_wrapper_lines_are_never_returned(wrapper: str) -> None:
    log = (startup_head()
           + record("EngineCore_DP0 pid=1234", "ERROR", "core.py:1510",
                    "EngineCore failed to start.")
           + api_server_tail().replace(WRAPPER_LINE, wrapper))
    assert find_root_cause(log) is None


def test_wrapper_after_real_cause_is_skipped() -> None:
    cause = find_root_cause(layout_log())
    assert cause is not None
    assert "See root cause above" not in cause and "EngineCore failed to start" not in cause


def test_ansi_codes_are_stripped() -> None:
    def colour(proc: str, level: str, where: str, *lines: str) -> str:
        prefix = (f"\x1b[0;36m({proc})\x1b[0;0m \x1b[31m{level}\x1b[0m "
                  f"\x1b[90m12-01 10:00:05\x1b[0m \x1b[90m[{where}]\x1b[0m ")
        return "\r\n".join(prefix + ln for ln in lines) + "\n"

    log = colour("EngineCore_DP0 pid=1234", "ERROR", "core.py:1510", "EngineCore failed to start.",
                 *core_frames(CPU_CACHE, "raise CpuCacheLayoutError(msg)"), LAYOUT_LINE)
    log += api_server_tail()
    cause = find_root_cause(log)
    assert cause == LAYOUT_LINE
    assert "\x1b" not in strip_ansi("\x1b[31mERROR\x1b[0m x") and strip_ansi("\x1b[1mA") == "A"


def test_log_without_error_gives_none() -> None:
    log = startup_head() + record("APIServer pid=1200", "INFO", "launcher.py:40",
                                  "Starting vLLM API server 0 on http://127.0.0.1:8100")
    assert find_root_cause(log) is None
    assert find_root_cause("") is None


def test_multi_line_message_keeps_its_continuation_lines_bounded() -> None:
    exc = ["pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig",
           "  Value error, No common block size for 16 [type=value_error, input_value=ArgsKwargs]",
           "    For further information visit https://errors.pydantic.dev/2.11/v/value_error"]
    log = failed_log(exc, f"{SITE}/pydantic/main.py", "validated_self = ...")
    assert find_root_cause(log) == "\n".join(exc)
    long = [BLOCK_LINE] + [f"  detail {i}" for i in range(10)]
    log = failed_log(long, f"{SITE}/vllm/v1/worker/utils.py", "raise ValueError(")
    cause = find_root_cause(log, max_lines=5)
    assert cause is not None
    lines = cause.splitlines()
    assert len(lines) == 5 and lines[0] == BLOCK_LINE and lines[-1].endswith("[...]")


def test_continuation_stops_at_the_next_writer() -> None:
    """Raw stderr after multiprocessing's traceback is not part of the message."""
    frames = core_frames(f"{SITE}/vllm/v1/worker/utils.py", "raise ValueError(")
    log = ("Process EngineCore_DP0:\n" + "\n".join(frames) + f"\n{BLOCK_LINE}\n"
           + record("APIServer pid=1200", "INFO", "core_client.py:700", "shutting down")
           + "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: "
           "resource_tracker: There appear to be 1 leaked semaphore objects\n"
           + api_server_tail())
    assert find_root_cause(log) == BLOCK_LINE


def test_interleaved_process_lines_do_not_break_a_traceback() -> None:
    frames = core_frames(f"{SITE}/vllm/v1/worker/utils.py", "raise ValueError(")
    lines = [f"(EngineCore_DP0 pid=1234) {ln}" for ln in frames]
    lines.insert(4, "(APIServer pid=1200) INFO 12-01 10:00:05 [utils.py:10] Waiting for engine")
    lines.append(f"(EngineCore_DP0 pid=1234) {BLOCK_LINE}")
    assert find_root_cause("\n".join(lines) + "\n" + api_server_tail()) == BLOCK_LINE


def test_error_record_without_traceback() -> None:
    log = (startup_head()
           + record("EngineCore_DP0 pid=1234", "ERROR", "core.py:1510",
                    "EngineCore failed to start.")
           + record("EngineCore_DP0 pid=1234", "ERROR", "cpu_worker.py:88",
                    "Not enough memory for the KV cache: VLLM_CPU_KVCACHE_SPACE=1 GiB,",
                    "the model needs 2 GiB")
           + record("APIServer pid=1200", "ERROR", "api_server.py:50", "API server exiting"))
    assert find_root_cause(log) == (
        "Not enough memory for the KV cache: VLLM_CPU_KVCACHE_SPACE=1 GiB,\nthe model needs 2 GiB"
    )


def test_traceback_beats_error_record_and_warning_traceback() -> None:
    warn = record("EngineCore_DP0 pid=1234", "WARNING", "platform.py:20",
                  "Triton not available:", *core_frames(f"{SITE}/triton/__init__.py", "import x"),
                  "ImportError: No module named 'triton'")
    err = record("APIServer pid=1200", "ERROR", "serving.py:20", "something else went wrong")
    log = warn + err + failed_log([BLOCK_LINE], f"{SITE}/vllm/v1/worker/utils.py",
                                  "raise ValueError(")
    assert find_root_cause(log) == BLOCK_LINE
    assert find_root_cause(warn) == "ImportError: No module named 'triton'"


def test_argparse_error() -> None:
    log = ("usage: api_server.py [-h] [--host HOST] [--port PORT]\n"
           "api_server.py: error: argument --block-size: invalid choice: 17 (choose from 1, 8, 16,"
           " 32, 64, 128)\n")
    cause = find_root_cause(log)
    assert cause is not None and cause.startswith("api_server.py: error: argument --block-size")


def test_read_root_cause_and_tail(tmp_path: Path) -> None:
    path = tmp_path / "prefill.log"
    assert read_root_cause(path) is None
    path.write_text(layout_log())
    assert read_root_cause(path) == LAYOUT_LINE
    assert log_tail("a\n\x1b[31mb\x1b[0m\r\nc\n", 2) == "b\nc"


# ---- EngineStartError (one class for both launchers) ------------------------------------------


class _ExitedPopen:
    """Stands in for subprocess.Popen of an engine that already exited."""

    pid = 999_999_999
    returncode = 1

    def poll(self) -> int:
        return self.returncode


def test_engine_start_error_message_leads_with_cause_and_log_path() -> None:
    exc = launch.EngineStartError("prefill engine", "exited with code 1",
                                  log_path=Path("/tmp/x/prefill.log"), root_cause=LAYOUT_LINE,
                                  tail="line 1\nline 2")
    assert str(exc).startswith(
        f"prefill engine failed to start: {LAYOUT_LINE}\n  full log: /tmp/x/prefill.log"
    )
    assert str(exc).endswith("last 2 lines of the log:\nline 1\nline 2")
    assert exc.root_cause == LAYOUT_LINE and exc.log_path == Path("/tmp/x/prefill.log")
    assert "line 1" not in exc.summary()


def test_launcher_failure_path_reports_the_root_cause(tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    log.write_text(layout_log())
    popen: Any = _ExitedPopen()
    proc = launch.ManagedProcess("prefill", popen, log, "http://127.0.0.1:1",
                                 label="prefill engine")
    with pytest.raises(launch.EngineStartError) as info:
        proc.wait_healthy(5)
    exc = info.value
    assert exc.root_cause == LAYOUT_LINE and exc.log_path == log
    message = str(exc)
    assert message.startswith(f"prefill engine failed to start: {LAYOUT_LINE}\n  full log: {log}")
    assert "exited with code 1" in message
    tail = message.split("lines of the log:\n", 1)[1]
    assert len(tail.splitlines()) <= 15 and "Failed core proc(s)" in tail


def test_launcher_failure_without_cause_keeps_a_long_tail(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_text("".join(f"INFO line {i}\n" for i in range(100)))
    popen: Any = _ExitedPopen()
    proc = launch.ManagedProcess("decode", popen, log, "http://127.0.0.1:1")
    with pytest.raises(launch.EngineStartError) as info:
        proc.wait_healthy(5)
    assert info.value.root_cause is None
    assert str(info.value).startswith("decode failed to start (exited with code 1 while starting)")
    assert f"full log: {log}" in str(info.value) and "INFO line 99" in str(info.value)
    assert "INFO line 59" not in str(info.value)


def test_bench_launcher_is_the_same_launcher(tmp_path: Path) -> None:
    from turbowire.bench_e2e import engines

    assert engines.EngineStartError is launch.EngineStartError
    assert engines.spawn is launch.spawn and engines.ManagedProcess is launch.ManagedProcess
    log = tmp_path / "tw-raw-prefill.log"
    log.write_text(failed_log([BLOCK_LINE], f"{SITE}/vllm/v1/worker/utils.py", "raise X("))
    popen: Any = _ExitedPopen()
    proc = launch.ManagedProcess("prefill-tw-raw", popen, log, "http://127.0.0.1:1",
                                 label="prefill engine (tw-raw)")
    with pytest.raises(launch.EngineStartError) as info:
        proc.wait_healthy(5)
    assert str(info.value).startswith(
        f"prefill engine (tw-raw) failed to start: {BLOCK_LINE}\n  full log: {log}"
    )


def test_demo_cli_prints_cause_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import turbowire.models as models
    import turbowire.serving.demo as demo_mod
    from turbowire.cli import app

    log = tmp_path / "prefill.log"
    log.write_text(layout_log())

    def fail(**_: object) -> None:
        raise launch.EngineStartError.from_log("prefill engine", "exited with code 1", log)

    monkeypatch.setattr(demo_mod, "run_demo", fail)
    monkeypatch.setattr(models, "ensure_smollm2", lambda: tmp_path)
    monkeypatch.setenv("COLUMNS", "400")
    result = CliRunner().invoke(app, ["demo", "--log-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    out = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "prefill engine failed to start" in out
    assert "CpuCacheLayoutError" in out and str(log) in out
    assert "Traceback" not in out


def test_print_start_error_without_cause_shows_tail() -> None:
    from rich.console import Console

    from turbowire.commands.demo import print_start_error

    buf = io.StringIO()
    exc = launch.EngineStartError("decode engine", "not healthy after 600 s",
                                  log_path=Path("/tmp/d.log"), tail="INFO loading weights")
    print_start_error(Console(file=buf, width=200), exc)
    text = buf.getvalue()
    assert "decode engine failed to start" in text and "/tmp/d.log" in text
    assert "INFO loading weights" in text
