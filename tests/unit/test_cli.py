"""The CLI's contract: exit codes, one-line errors, --cmd equivalence, generated reference."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from swarm_core.config.schemas import ModelConfig
from swarm_core.contract import LinkChange, Topology
from swarm_core.protocol import LinkLimits
from swarm_tui.cli import build_parser, main_tui, run
from swarm_tui.commands.base import ExitCode
from swarm_tui.commands.meta import render_llm_doc
from tests.clusters import free_port
from tests.support import REPO


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {text!r}"
    return lines[0]


@pytest.mark.parametrize("argv, needle", [
    (["set-speed", "--fellow-id", "x", "--tx-mbps", "1"], "--fellow-id"),
    (["set-speed", "--fellow-id", "0", "--tx-mbps", "-5"], "--tx-mbps"),
    (["set-speed", "--fellow-id", "0", "--latency-ms", "1e9"], "--latency-ms"),
    (["restart-cluster", "--fellows", "0"], "--fellows"),
    (["release", "--all", "--fellow-id", "1"], "not allowed with"),
    (["jobs", "--state", "DONE"], "--state"),
    (["fellows", "--format", "yaml"], "--format"),
    (["no-such-command"], "no-such-command"),
    (["leader", "--port", "70000"], "--port"),
    (["restart-cluster", "--fellows", "1000"], "<= 64, got 1000"),
    (["restart-cluster", "--devices", "cuda:x"], "'cuda:x' is not 'cpu' or 'cuda:N'"),
    (["submit", "--fellows", "2000"], "<= 1024, got 2000"),
    (["submit", "--steps", "99999999999999999999"], "<= 9223372036854775807"),
    (["set-speed", "--fellow-id", "0", "--tx-mbps", "1e300"], "rate in Mbit/s must be >= 0.001"),
    (["set-speed", "--fellow-id", "0", "--rx-mbps", "0.0001"], "--rx-mbps"),
    (["set-speed", "--stage", "-1"], "stage or replica index must be >= 0"),
    # As the console's form reads them: ASCII decimal numbers only.
    (["set-speed", "--fellow-id", "0", "--tx-mbps", "nan"], "expected a number"),
    (["set-speed", "--fellow-id", "0", "--tx-mbps", "1_000"], "got '1_000'"),
    (["set-speed", "--fellow-id", "0", "--latency-ms", "\u0663"], "--latency-ms"),
    (["fellow", "--threads", "300"], "thread count must be >= 1 and <= 256, got 300"),
    (["set-speed", "--fellow-id", "0", "--slowdown", "0.5"],
     "argument --slowdown: slowdown must be >= 1 and <= 100, got 0.5"),
    (["set-speed", "--fellow-id", "0", "--slowdown", "1000"], "--slowdown"),
    (["set-speed", "--fellow-id", "0", "--slowdown", "fast"], "expected a number (slowdown)"),
    (["fellow", "--slowdown", "0"], "argument --slowdown: slowdown must be >= 1"),
    (["restart-cluster", "--threads", "5000"], "--threads"),
    (["generate", "--model", "m", "--prompt", "x", "--threads", "100000"], "--threads"),
    (["generate", "--model", "m", "--prompt", "x", "--tokens", "10000000"],
     "token count must be >= 1 and <= 1000000"),
])
def test_bad_flags_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        run(argv)
    assert exc.value.code == ExitCode.USAGE
    err = _one_line(capsys.readouterr().err)
    assert needle in err


@pytest.mark.parametrize("argv, needle", [
    (["--leader-url", "notaurl", "fellows"], "leader URL 'notaurl' is not http(s)://host[:port]"),
    (["--leader-url", "http://[::1", "fellows"], "'http://[::1' is not http(s)://host[:port]: "
                                                 "Invalid IPv6 URL"),
    (["--leader-url", "http://127.0.0.1:99999", "jobs"], "Port out of range"),
    (["--leader-url", "http://127.0.0.1:abc", "jobs"], "Port could not be cast"),
    (["--leader-url", "http://me:secret@127.0.0.1:0", "jobs"],
     "'http://me:***@127.0.0.1:0' has port 0"),
    (["fellow", "--leader-url", "http://127.0.0.1:9", "--name", "x" * 300],
     "--name: must be 1-128 characters"),
    (["fellow", "--leader-url", "http://127.0.0.1:9", "--name", ""],
     "--name: must be 1-128 characters"),
    (["--leader-url", "", "fellows"], "--leader-url is empty"),
    (["--leader-url", "http://127.0.0.1:9", "--token", "", "jobs"], "--token is empty"),
    (["--leader-url", "http://127.0.0.1:9", "submit", "--name", ""], "--name is empty"),
    (["--leader-url", "http://127.0.0.1:9", "submit", "--payload", "p.json", "--steps", "3",
      "--fellows", "2"], "--payload is the whole job body; --fellows, --steps would be ignored"),
    (["set-speed", "--tx-mbps", "8"], "set-speed needs --fellow-id N, or --stage K"),
    (["set-speed", "--fellow-id", "1", "--stage", "0"], "set-speed needs --fellow-id N, or"),
])
def test_bad_values_found_after_parsing_are_usage_errors_too(argv, needle, capsys):
    assert run(argv) == ExitCode.USAGE
    assert needle in _one_line(capsys.readouterr().err)


def test_a_job_id_cannot_walk_to_another_route(capsys):
    """The id is one path segment, escaped: ``../info`` asks for a job of that name."""
    from aiohttp import web

    seen: list[str] = []

    async def any_route(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({"error": {"code": "not_found", "message": "no such job"}},
                                 status=404)

    async def serve_and_ask() -> int:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", any_route)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await asyncio.to_thread(run, ["--leader-url", f"http://127.0.0.1:{port}",
                                                 "--token", "t", "job", "../info"])
        finally:
            await runner.cleanup()

    code = asyncio.run(serve_and_ask())
    assert seen == ["/api/v1/jobs/..%2Finfo"]
    assert code != 0 and "no such job" in _one_line(capsys.readouterr().err)


def test_release_needs_a_target(capsys):
    assert run(["release", "--leader-url", "http://127.0.0.1:9"]) == ExitCode.USAGE
    assert "--all or --fellow-id" in _one_line(capsys.readouterr().err)


def test_forget_needs_a_target(capsys):
    assert run(["forget", "--leader-url", "http://127.0.0.1:9"]) == ExitCode.USAGE
    assert "--gone or --fellow-id" in _one_line(capsys.readouterr().err)


async def test_swarm_forget_drops_gone_fellows_and_refuses_a_live_one(api, auth, capsys):
    """`swarm forget --fellow-id N` drops a fellow that left; a live one is refused in one
    line (exit 1); `--gone` forgets every fellow that is not live and keeps the others."""
    from swarm_core.protocol import SESSION_HEADER
    from tests.support import TOKEN

    regs = []
    for name in ("a", "b", "c"):
        resp = await api.post("/api/v1/fellows/register", headers=auth,
                              json={"name": name, "instance_id": f"{name}-i"})
        regs.append(await resp.json())
    for reg in regs[1:]:  # (b and c leave)
        resp = await api.post(f"/api/v1/fellows/{reg['fellow_id']}/heartbeat",
                              json={"status": "released"},
                              headers={**auth, SESSION_HEADER: reg["session"]})
        assert resp.status == 200

    def cli(*argv: str) -> int:
        return run(["--leader-url", str(api.make_url("")).rstrip("/"), "--token", TOKEN, *argv])

    assert await asyncio.to_thread(cli, "forget", "--fellow-id", "0") == ExitCode.FAILURE
    err = _one_line(capsys.readouterr().err)
    assert "fellow 0 not forgotten" in err and "still heartbeats" in err
    assert await asyncio.to_thread(cli, "forget", "--fellow-id", "1") == ExitCode.OK
    assert "forgot fellow(s) 1" in capsys.readouterr().out
    assert await asyncio.to_thread(cli, "forget", "--gone", "--format", "json") == ExitCode.OK
    assert json.loads(capsys.readouterr().out) == {"forgotten": [2], "kept": []}
    listed = (await (await api.get("/api/v1/fellows", headers=auth)).json())["fellows"]
    assert [f["fellow_id"] for f in listed] == [0]


def test_slowdown_flags_parse_with_their_defaults():
    p = build_parser()
    assert p.parse_args(["fellow", "--slowdown", "4"]).slowdown == 4.0
    assert p.parse_args(["fellow"]).slowdown == 1.0
    assert p.parse_args(["set-speed", "--fellow-id", "0"]).slowdown is None


async def test_swarm_set_speed_slowdown_alone_keeps_the_link(api, auth, capsys):
    """`swarm set-speed --slowdown X` sends the slowdown alone (the fellow's link stays as it
    is); with a link flag beside it, both go."""
    from swarm_core.protocol import SESSION_HEADER
    from tests.support import TOKEN

    resp = await api.post("/api/v1/fellows/register", headers=auth,
                          json={"name": "a", "instance_id": "a-i"})
    reg = await resp.json()

    def cli(*argv: str) -> int:
        return run(["--leader-url", str(api.make_url("")).rstrip("/"), "--token", TOKEN, *argv])

    assert await asyncio.to_thread(cli, "set-speed", "--fellow-id", "0",
                                   "--slowdown", "4") == ExitCode.OK
    assert "slowdown 4x (emulated)" in capsys.readouterr().out
    assert await asyncio.to_thread(cli, "set-speed", "--fellow-id", "0", "--tx-mbps", "8",
                                   "--slowdown", "2", "--format", "json") == ExitCode.OK
    out = json.loads(capsys.readouterr().out)
    assert out["slowdown"] == 2.0 and out["link"]["tx_mbps"] == 8.0
    sigs = (await (await api.get("/api/v1/fellows/0/signals", params={"after": 0, "wait": 0},
                                 headers={**auth, SESSION_HEADER: reg["session"]})).json())
    assert [s["payload"] for s in sigs["signals"]] == [
        {"slowdown": 4.0},
        {"tx_mbps": 8.0, "rx_mbps": None, "latency_ms": 0.0, "slowdown": 2.0}]


@pytest.mark.parametrize("argv", [["fellows"], ["fellow"]])
def test_no_leader_configured_exits_3(argv, capsys):
    assert run(argv) == ExitCode.UNREACHABLE
    assert "no leader" in _one_line(capsys.readouterr().err)


def test_a_leader_state_dir_that_is_a_file_is_named(tmp_path, capsys):
    a_file = tmp_path / "state"
    a_file.write_text("x")
    assert run(["leader", "--state-dir", str(a_file)]) == ExitCode.USAGE
    assert f"--state-dir: {a_file} is not a directory" in _one_line(capsys.readouterr().err)


def test_unreachable_leader_exits_3(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert run(["--leader-url", url, "jobs"]) == ExitCode.UNREACHABLE
    assert _one_line(capsys.readouterr().err) == (
        f"swarm: cannot reach the leader at {url}: connection refused (is the leader running "
        "there?)")
    assert run(["--leader-url", url, "jobs"]) == ExitCode.UNREACHABLE
    assert "cannot reach the leader" in _one_line(capsys.readouterr().err)


def test_global_flags_may_follow_the_command(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert run(["jobs", "--leader-url", url, "--token", "t"]) == ExitCode.UNREACHABLE
    assert url in capsys.readouterr().err


def test_bad_payload_file_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "job.json"
    bad.write_text(json.dumps({"name": "x", "topology": {"fellows": "two"}}))
    code = run(["--leader-url", "http://127.0.0.1:9", "submit", "--payload", str(bad)])
    assert code == ExitCode.USAGE
    err = _one_line(capsys.readouterr().err)
    assert "$.topology.fellows" in err and "expected an integer" in err


def test_leader_refuses_non_loopback_without_flag(capsys):
    assert run(["leader", "--host", "0.0.0.0"]) == ExitCode.USAGE
    assert "--allow-remote" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("devices, needle", [
    ("cpu,gpu0", "'gpu0' is not 'cpu' or 'cuda:N'"),
    ("cpu,cuda:99", "--devices: cuda:99: "),  # no machine here has a hundred GPUs
])
def test_fellow_refuses_a_device_slot_it_cannot_serve(devices, needle, capsys):
    # Refused before it registers (nothing listens at the URL): never trained on the CPU.
    url = f"http://127.0.0.1:{free_port()}"
    assert run(["fellow", "--leader-url", url, "--devices", devices]) == ExitCode.USAGE
    assert needle in _one_line(capsys.readouterr().err)


def test_swarm_tui_cmd_maps_to_the_same_action(capsys):
    assert main_tui(["--cmd", "info", "--format", "json"]) == 0
    via_tui = json.loads(capsys.readouterr().out)
    assert run(["info", "--format", "json"]) == 0
    via_swarm = json.loads(capsys.readouterr().out)
    assert via_tui == via_swarm
    assert main_tui(["--cmd=info", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == via_swarm


def test_swarm_tui_cmd_without_action(capsys):
    assert main_tui(["--cmd"]) == ExitCode.USAGE
    _one_line(capsys.readouterr().err)


def test_swarm_tui_refuses_a_configs_dir_that_is_not_one(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    for bad, says in ((tmp_path / "nope", f"{tmp_path / 'nope'} is not a directory"),
                      (tmp_path / "f", f"{tmp_path / 'f'} is not a directory"),
                      ("~no-such-user-swarm/x", "~no-such-user-swarm/x: no such user's home")):
        with pytest.raises(SystemExit) as exc:
            main_tui(["--configs", str(bad)])
        assert exc.value.code == ExitCode.USAGE
        assert f"--configs: {says}" in _one_line(capsys.readouterr().err)


def test_llm_doc_covers_every_command_and_exit_code():
    parser = build_parser()
    text = render_llm_doc(parser)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert f"### `swarm {name}`" in text
        for action in p._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text
    for code in ExitCode:
        assert f"| {int(code)} | {code.name} |" in text


def test_committed_cli_reference_is_current():
    committed = (REPO / "docs" / "llm_swarm_cli.md").read_text()
    assert committed == render_llm_doc(build_parser()), \
        "docs/llm_swarm_cli.md is stale: run 'swarm llm-doc'"


def test_llm_doc_writes_the_file(tmp_path: Path, capsys):
    out = tmp_path / "ref.md"
    assert run(["llm-doc", "--output", str(out)]) == 0
    assert out.read_text().startswith("# `swarm` / `swarm-tui --cmd` reference")


def test_api_doc_lists_every_route():
    from swarm_core.leader.openapi import route_table_markdown
    from swarm_core.leader.routes import ROUTES

    text = (REPO / "docs" / "api.md").read_text()
    assert route_table_markdown(ROUTES) in text, \
        "docs/api.md route table is stale: run 'python -m swarm_core.leader.openapi'"


def test_watch_lines_say_the_step_loss_and_a_mid_run_evaluation():
    from swarm_tui.commands.jobs import _describe

    def metric(**data):
        return {"type": "metric", "data": {"state": "RUNNING", "step": 40, "fellow_id": 1,
                                           **data}}

    assert _describe(metric(loss=2.5, tokens_per_s=1234.4, metrics={})) == \
        "step 40  fellow 1  loss 2.5000  1234 tok/s"
    assert _describe(metric(metrics={"eval_loss": 2.0})) == \
        "step 40  eval loss 2.0000  perplexity 7.39"
    # A stage without the loss says nothing: the last stage speaks for all.
    assert _describe(metric(metrics={"wire_tx_bytes": 10})) is None


@pytest.mark.parametrize("flag, needle", [
    ("0.0.0.0", "'0.0.0.0' is a bind-all address"), ("10.0.0.1:9000", "without a port"),
    ("0", "'0' is a bind-all address"),
    (" ", "expected a host name or address")])
def test_fellow_refuses_an_advertised_host_neighbours_cannot_dial(flag, needle, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exc:
        run(["fellow", "--leader-url", url, "--data-advertise", flag])
    assert exc.value.code == ExitCode.USAGE
    err = _one_line(capsys.readouterr().err)
    assert "--data-advertise" in err and needle in err


@pytest.mark.parametrize("command", [["fellow"], ["restart-cluster"]])
def test_a_data_root_must_be_a_directory(command, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    for bad in (str(tmp_path / "nope"), str(tmp_path / "file.txt")):
        with pytest.raises(SystemExit) as exc:
            run([*command, "--leader-url", f"http://127.0.0.1:{free_port()}", "--data-root", bad]
                if command == ["fellow"] else [*command, "--data-root", bad])
        assert exc.value.code == ExitCode.USAGE
        err = _one_line(capsys.readouterr().err)
        assert f"--data-root: {bad} is not a directory" in err


def test_the_advertised_data_host_is_one_neighbours_can_dial():
    """What a fellow registers: --data-advertise when given, else --data-host, else (bind-all)
    the address this machine reaches the leader from; the listener reports it as its addr."""
    from swarm_core.fellow.daemon import FellowOptions, advertised_host
    from swarm_core.pipeline.listener import DataListener

    def opts(**kw):
        return FellowOptions(leader_url="http://127.0.0.1:8765", token=None, name="f", **kw)

    assert advertised_host(opts()) == "127.0.0.1"
    assert advertised_host(opts(data_host="127.0.0.3")) == "127.0.0.3"
    assert advertised_host(opts(data_host="0.0.0.0")) == "127.0.0.1"  # nothing is bound
    assert advertised_host(opts(data_host="0.0.0.0", data_advertise="node7.lan")) == \
        "node7.lan"
    ln = DataListener("127.0.0.1", 0, advertise="127.0.0.2")
    try:
        assert ln.addr == f"127.0.0.2:{ln.port}"
        assert ln.sock.getsockname()[0] == "127.0.0.1"
    finally:
        ln.close()



def test_swarm_job_shows_the_newest_set_speeds_and_counts_them_all():
    from swarm_tui.commands.jobs import link_change_rows

    changes = [LinkChange(at_step=s, fellow_id=0, at=0.0,
                          link=LinkLimits(tx_mbps=8.0, rx_mbps=None, latency_ms=20.0))
               for s in range(1, 6)]
    assert link_change_rows(changes[:1]) == [
        ["link set @1", "fellow 0: tx 8 Mbit/s, rx unlimited, +20 ms"]]
    rows = link_change_rows(changes, total=300, shown=2)
    assert rows[0] == ["link set", "300 times, the first @1; the newest 2:"]
    assert [r[0] for r in rows[1:]] == ["link set @4", "link set @5"]
    assert [r[0] for r in link_change_rows(changes, shown=5)] == [
        f"link set @{s}" for s in range(1, 6)]


@pytest.mark.parametrize("content, needle", [
    ("null", ": $: expected an object"),
    ("[1, 2]", ": $: expected an object"),
    ('{"d_model": "wide"}', ": $.d_model:"),
])
def test_submit_refuses_a_profile_that_is_not_one_naming_the_file(content, needle, tmp_path,
                                                                  capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    for flag in ("--model", "--training"):
        if flag == "--training" and "d_model" in content:
            continue
        assert run(["--leader-url", "http://127.0.0.1:9", "submit", flag, str(bad)]) == \
            ExitCode.USAGE
        assert f"{bad}{needle}" in _one_line(capsys.readouterr().err)


def test_submit_runs_a_sweep_training_profile_as_its_job(tmp_path):
    """A shipped training profile names its cluster, network and artifacts too: one job of it
    takes its fellows, its link limits and its shard push interval."""
    from swarm_core.config.profiles import load_job_training
    from swarm_tui.commands.jobs import train_job

    shipped = REPO / "exp/configs/training/distributed_smoke.json"
    training, fellows = load_job_training(shipped)
    assert fellows == 2 and training["shard_push_interval_steps"] == 6
    assert training["link"] is None and training["steps"] == 12
    body = json.loads(shipped.read_text())
    body.update({"cluster_profile": {"fellows": 3},
                 "network_profile": {"name": "slow", "tx_mbps": 8, "latency_ms": 20}})
    (tmp_path / "t.json").write_text(json.dumps(body))
    training, fellows = load_job_training(tmp_path / "t.json")
    assert fellows == 3
    assert training["link"] == {"tx_mbps": 8.0, "rx_mbps": None, "latency_ms": 20.0}
    job = train_job(ModelConfig(name="m"), training, Topology(fellows),  # as the leader does
                    "m")
    assert job.topology.fellows == 3 and job.training.link.tx_mbps == 8.0
    # A profile without those sections keeps the training fields it sets itself.
    plain = {"steps": 3, "shard_push_interval_steps": 2, "link": {"tx_mbps": 5}}
    (tmp_path / "p.json").write_text(json.dumps(plain))
    training, fellows = load_job_training(tmp_path / "p.json")
    assert fellows is None and training["shard_push_interval_steps"] == 2
    assert training["link"] == {"tx_mbps": 5.0, "rx_mbps": None, "latency_ms": 0.0}
    # A job's own training profile names no cluster: the fellows are the flag's (default 1).
    assert load_job_training(REPO / "exp/configs/training/quickstart_shakespeare.json")[1] \
        is None


def test_an_unreadable_local_cluster_record_is_named_not_taken_for_none(capsys):
    """stop-cluster must not say "no local cluster" while the processes a damaged record
    names may run on; a leader named outright does not need the record."""
    from swarm_core.local_cluster import record_path

    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"leader_url": "http://127.')  # cut short
    for argv in (["fellows"], ["stop-cluster"], ["restart-cluster", "--fellows", "1"]):
        assert run(argv) == ExitCode.FAILURE, argv
        assert f"{path}: unreadable local cluster record" in _one_line(capsys.readouterr().err)
    assert path.exists(), "the record stays for the user to act on"
    url = f"http://127.0.0.1:{free_port()}"
    assert run(["--leader-url", url, "jobs"]) == ExitCode.UNREACHABLE
    assert "cannot reach the leader" in _one_line(capsys.readouterr().err)


def test_a_leader_state_that_is_not_one_is_named_in_one_line(tmp_path, capsys):
    state = tmp_path / "state"
    state.mkdir()
    (state / "token").write_bytes(b"\xff\xfe")
    assert run(["leader", "--port", "0", "--state-dir", str(state)]) == ExitCode.FAILURE
    assert f"{state / 'token'}: not a token" in _one_line(capsys.readouterr().err)
    (state / "token").unlink()
    (state / "leader.sqlite3").write_text("not a database\n" * 10)
    assert run(["leader", "--port", "0", "--state-dir", str(state)]) == ExitCode.FAILURE
    assert f"{state / 'leader.sqlite3'}: cannot open the leader's state: file is not a " \
        "database" in _one_line(capsys.readouterr().err)
    assert (state / "leader.sqlite3").read_text() == "not a database\n" * 10, "left as it was"
    (state / "leader.sqlite3").unlink()
    (state / "leader.sqlite3").mkdir()
    assert run(["leader", "--port", "0", "--state-dir", str(state)]) == ExitCode.FAILURE
    assert f"{state / 'leader.sqlite3'}: cannot open the leader's state: unable to open" in \
        _one_line(capsys.readouterr().err)


def test_a_local_clusters_bad_token_file_is_named_not_sent(tmp_path, capsys):
    """Sending it would earn a 401 that blames the token, not the file."""
    from swarm_core.local_cluster import record_path

    state = tmp_path / "state"
    state.mkdir()
    (state / "token").write_bytes(b"two words\n")
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "leader_url": "http://127.0.0.1:9", "state_dir": str(state), "started_at": 0.0,
        "leader": {"name": "leader", "pid": 1, "log": "x"}, "fellows": []}))
    assert run(["jobs"]) == ExitCode.FAILURE
    assert f"{state / 'token'}: not a token (it holds whitespace)" in \
        _one_line(capsys.readouterr().err)


def test_a_swarm_home_that_is_a_file_is_named(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "home"
    a_file.write_text("x")
    monkeypatch.setenv("SWARM_HOME", str(a_file))
    assert run(["restart-cluster", "--fellows", "1"]) == ExitCode.USAGE
    assert f"SWARM_HOME: {a_file} is not a directory" in _one_line(capsys.readouterr().err)


def test_a_suite_out_that_cannot_be_a_directory_is_a_usage_error(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    suite = str(REPO / "exp/configs/benchmarks/multinode_training_v1.json")
    for out, needle in ((a_file, f"--out: {a_file} is not a directory"),
                        (a_file / "x", f"--out: {a_file} is not a directory")):
        assert run(["--leader-url", "http://127.0.0.1:9", "suite", "--suite", suite,
                    "--dry-run", "--out", str(out)]) == ExitCode.USAGE
        assert needle in _one_line(capsys.readouterr().err)
    assert a_file.read_text() == "x"


def test_llm_doc_output_under_a_file_is_a_usage_error(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert run(["llm-doc", "--output", str(a_file / "cli.md")]) == ExitCode.USAGE
    assert f"--output: {a_file} is not a directory" in _one_line(capsys.readouterr().err)


def test_a_sweeps_closing_table_names_a_damaged_summary_and_shows_the_rest(tmp_path, capsys):
    """The sweep's closing table reads run summaries through the report's checks: a damaged
    one is one line on stderr and a row of '-', not a traceback that hides every run."""
    from types import SimpleNamespace

    from swarm_tui.commands.sweeps import _report

    good, bad, queued = (tmp_path / n for n in ("good", "bad", "queued"))
    for d in (good, bad, queued):
        d.mkdir()
    (good / "metrics_summary.json").write_text(json.dumps(
        {"final_loss": 2.25, "eval_loss": 2.5, "tokens_per_s": 1234.0, "thresholds_met": True}))
    (bad / "metrics_summary.json").write_text(json.dumps({"final_loss": "low"}))
    states = [SimpleNamespace(run_id=f"20261201-x-{i}-{d.name}", job_id=f"job-00000{i}",
                              state=state, run_dir=d)
              for i, (d, state) in enumerate([(good, "COMPLETED"), (bad, "COMPLETED"),
                                              (queued, "PENDING")], start=1)]
    _report(SimpleNamespace(states=states), "json")
    out, err = capsys.readouterr()
    rows = {r["run_id"].rsplit("-", 1)[-1]: r for r in json.loads(out)["runs"]}
    assert rows["good"]["final_loss"] == 2.25 and rows["good"]["thresholds_met"] is True
    assert rows["bad"]["final_loss"] is None and rows["queued"]["final_loss"] is None
    assert err == f'{bad}/metrics_summary.json: final_loss is "low", not a number\n'
