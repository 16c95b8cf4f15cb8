"""Per-pair links across fellow processes (issue 40 point 1): three fellows at three sites of a
link matrix, each peer link shaped by its pair; the fellows' heartbeats and the job's run
summary give each pair's settings, bytes and achieved rate; `swarm set-speed --to` changes
one pair live and the job records it."""

from __future__ import annotations

import json

import pytest

from tests.clusters import cli_json, job_view, leader_call, run_cli, wait_until

pytestmark = pytest.mark.slow

# (frames of 16 KiB, four a step each way: every link below is the step's bottleneck, so the
# rate a pair achieves is its own, not the 64 KiB burst of an idle bucket)
MODEL = {"name": "tiny", "d_model": 64, "n_layers": 3, "n_heads": 2, "seq_len": 32,
         "compression": "none", "wire_dtype": "fp32"}
NETWORK = {"sites": {"a": {}, "b": {"up_mbps": 50}, "c": {}},
           "links": {"a": {"b": {"mbps": 4, "latency_ms": 2}, "c": {"mbps": 30}},
                     "b": {"c": {"mbps": 1, "latency_ms": 5}},
                     "c": {"b": {"mbps": 3}}},
           "stage_sites": ["a", "b", "c"]}
TRAINING = {"name": "pairs", "dataset": "shakespeare", "steps": 20, "batch_size": 8,
            "micro_batches": 4, "eval_batches": 1, "seed": 5, "network": NETWORK}


def test_three_sites_shape_each_pair_report_it_and_take_a_live_pair_change(cli_env, tmp_path):
    up = run_cli("restart-cluster", "--fellows", "3", env=cli_env, timeout=90)
    assert up.returncode == 0, up.stderr
    try:
        path = tmp_path / "job.json"
        path.write_text(json.dumps({"name": "pairs", "kind": "train", "model": MODEL,
                                    "training": TRAINING, "topology": {"stages": 3}}))
        job_id = cli_json("submit", "--payload", str(path), env=cli_env)["job_id"]
        running = wait_until(lambda: (j := job_view(job_id, cli_env))["last_step"] >= 3
                             and j, 90, "the job's third step")
        fellow = {s["stage"]: s["fellow_id"] for s in running["placement"]["stages"]}
        # The middle fellow's heartbeat names its two pairs as the matrix set them.
        shown = wait_until(lambda: (f := leader_call("GET", f"/fellows/{fellow[1]}",
                                                     cli_env))["peers"] and f, 20, "peers")
        assert [(p["peer"], p["peer_fellow"], p["site"], p["peer_site"], p["tx_mbps"])
                for p in shown["peers"]] == [("0.0", fellow[0], "b", "a", 4.0),
                                             ("2.0", fellow[2], "b", "c", 1.0)]
        # Live, per pair: stage 1's link to stage 2 from 1 to 8 Mbit/s; its link to stage 0
        # and every other fellow's limits stay.
        done = run_cli("set-speed", "--fellow-id", str(fellow[1]), "--to", str(fellow[2]),
                       "--tx-mbps", "8", "--latency-ms", "3", env=cli_env)
        assert done.returncode == 0, done.stderr
        assert f"fellow {fellow[1]} (its links to fellow {fellow[2]})" in done.stdout
        changed = wait_until(lambda: [p for p in leader_call(
            "GET", f"/fellows/{fellow[1]}", cli_env)["peers"] if p["tx_mbps"] == 8.0],
            20, "the pair's new rate")
        assert [(p["peer"], p["latency_ms"]) for p in changed] == [("2.0", 3.0)]
        # A pair that is not there, and a slowdown given per pair, are refused.
        bad = run_cli("set-speed", "--fellow-id", str(fellow[0]), "--to", str(fellow[2]),
                      "--tx-mbps", "8", env=cli_env)
        assert bad.returncode != 0 and "no link to fellow" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
        job = wait_until(lambda: (j := job_view(job_id, cli_env))["state"] in (
            "COMPLETED", "FAILED") and j, 180, "the job's end")
    finally:
        run_cli("stop-cluster", env=cli_env)
    assert job["state"] == "COMPLETED", job["reason"]
    assert [(c["fellow_id"], c["to_fellow"], c["link"]["tx_mbps"])
            for c in job["link_changes"]] == [(fellow[1], fellow[2], 8.0)]
    stages = job["metrics"]["stages"]
    pairs = {s: {p["peer"]: p for p in stages[str(s)]["peer_links"]} for s in range(3)}
    # What one end of a pair sent, the other received; each pair's wire bytes are the
    # stage's whole wire bytes split by neighbour.
    assert pairs[0]["1.0"]["tx_bytes"] == pairs[1]["0.0"]["rx_bytes"] > 0
    assert pairs[1]["2.0"]["tx_bytes"] == pairs[2]["1.0"]["rx_bytes"] > 0
    assert pairs[2]["1.0"]["tx_bytes"] == pairs[1]["2.0"]["rx_bytes"] > 0
    assert pairs[1]["2.0"]["tx_mbps"] == 8.0 and pairs[1]["0.0"]["tx_mbps"] == 4.0
    # Loosely (bench/bench_links.py holds the tight figure): no pair moved its bytes faster
    # than its rate allows (beyond the bucket's 64 KiB burst), so the run lasted at least as
    # long as its slowest pair needed. (A pair's achieved rate is the rate its frames left at
    # while leaving: where the step waits on something else, its bucket refills between
    # steps and a frame leaves at once, so it reads above the setting: reported, not bounded.)
    for s, peer, rate in ((0, "1.0", 4.0), (2, "1.0", 3.0)):
        p = pairs[s][peer]
        needed = (p["tx_bytes"] - 65536) * 8 / (rate * 1e6)
        assert stages[str(s)]["wall_s"] >= 0.9 * needed, (p, stages[str(s)]["wall_s"])
        assert p["achieved_mbps"] > 0
