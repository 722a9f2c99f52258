"""The launcher's spawn: its own process group in the caller's session, the log where the caller
names it, the cwd it is given."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from turbowire.serving.launch import EngineSpec, spawn


def _print_cwd() -> list[str]:
    return [sys.executable, "-c",
            "import os; print(os.getcwd()); print(os.getpgid(0)); print(os.getsid(0))"]


def test_spawn_runs_in_the_log_dir_in_its_own_group_of_the_callers_session(tmp_path: Path,
                                                                            ) -> None:
    proc = spawn("probe", _print_cwd(), dict(os.environ), tmp_path / "logs", "http://127.0.0.1:1")
    assert proc.popen.wait(timeout=30) == 0
    assert proc.log_path == tmp_path / "logs" / "probe.log"
    cwd, pgid, sid = proc.log_text().split()
    assert Path(cwd) == (tmp_path / "logs").resolve()
    assert int(pgid) == proc.popen.pid  # its own process group: stop() kills all of it
    # the caller's session: Linux's autogroup scheduler shares the CPU per session, and a TP 2
    # engine's busy-waiting ranks starved an engine of another session (launch.py)
    assert int(sid) == os.getsid(0)
    proc.stop(timeout=1)


@pytest.mark.parametrize("where", ["caller", "explicit"])
def test_spawn_takes_a_log_name_and_a_cwd(tmp_path: Path, where: str) -> None:
    cwd = Path.cwd() if where == "caller" else tmp_path
    proc = spawn("probe", _print_cwd(), dict(os.environ), tmp_path / "out", "http://127.0.0.1:1",
                 log_name="cfg-probe.log", cwd=cwd)
    assert proc.popen.wait(timeout=30) == 0
    assert proc.log_path == tmp_path / "out" / "cfg-probe.log"
    assert Path(proc.log_text().split()[0]) == cwd.resolve()


def test_engine_spec_host_sets_the_listen_address_and_url(tmp_path: Path) -> None:
    local = EngineSpec("p", tmp_path, 8100, cpu=0)
    remote = EngineSpec("d", tmp_path, 8200, cpu=1, host="10.1.2.3")
    assert local.url == "http://127.0.0.1:8100" and remote.url == "http://10.1.2.3:8200"
    cmd = remote.command()
    assert cmd[cmd.index("--host") + 1] == "10.1.2.3"


def test_engine_commands_parse_with_vllms_own_parser_and_carry_the_guard(tmp_path: Path) -> None:
    """Every flag the launcher passes is one `vllm serve` accepts; engines with a connector get
    the API-server guard against transfer params smuggled in vllm_xargs."""
    import importlib

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from turbowire.serving.launch import HTTP_GUARD, turbowire_kv_config

    spec = EngineSpec("p", tmp_path, 8100, cpu=0, dtype="float16",
                      kv_transfer_config=turbowire_kv_config(preset="tq4"))
    cmd = spec.command()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[cmd.index("--model"):])
    assert args.middleware == [HTTP_GUARD] and args.dtype == "float16"
    module, name = HTTP_GUARD.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))
    plain = EngineSpec("q", tmp_path, 8101, cpu=1).command()
    assert "--middleware" not in plain  # no connector, no transfer params to guard
