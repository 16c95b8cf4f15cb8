"""Selective compression (issue 34 point 4): ``training.compress_when`` applies the boundary's
and the sync's compression only on a class of links (under a rate in the link matrix, or of
named replicas); every other link sends as spec ``none`` does. The rule, its checks, and a
2 x 2 job in one process over loopback TCP."""

from __future__ import annotations

import pytest

from swarm_core.config.schemas import ModelConfig, TrainingConfig, job_shape_error
from swarm_core.config.selective import boundary_compresses, group_compresses, link_mbps
from swarm_core.contract import split_layers
from swarm_core.contract.metrics import step_loss
from swarm_core.data import load_token_data
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.model import StageModule
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import StageResult, expected_wire_bytes
from swarm_core.pipeline.wire_math import step_boundary_bytes, step_wire_bytes
from swarm_core.schema import SchemaError, structure

# Replica 0 in a data centre, replica 1 split between it and a home (110 up, 500 down),
# replica 2 at home.
HOME = {"sites": {"dc": {}, "home": {"up_mbps": 110, "down_mbps": 500}},
        "links": {"dc": {"home": {"mbps": 1000}}},
        "cell_sites": [["dc", "dc"], ["dc", "home"], ["home", "home"]]}


def training(rule: dict | None, network: dict | None = HOME, **over) -> TrainingConfig:
    return structure({"network": network, "compress_when": rule, **over}, TrainingConfig)


def test_a_links_rate_is_its_pairs_and_its_sites_caps_the_least():
    net = training(None).network
    assert net is not None
    assert link_mbps(net, (0, 1), (1, 1), 2) == 500  # dc -> home: the home's down cap
    assert link_mbps(net, (1, 1), (0, 1), 2) == 110  # home -> dc: its up cap
    assert link_mbps(net, (0, 0), (1, 0), 2) is None  # within the dc: unshaped
    assert link_mbps(net, (0, 2), (1, 2), 2) == 110  # within the home: its caps still


def test_below_mbps_selects_each_direction_of_a_link_and_each_group_whole():
    t = training({"below_mbps": 200})
    # Replica 1's boundary: activations to the home go at 500 (left out), gradients back
    # at 110 (coded).
    assert not boundary_compresses(t, (0, 1), (1, 1), 2)
    assert boundary_compresses(t, (1, 1), (0, 1), 2)
    assert not boundary_compresses(t, (0, 0), (1, 0), 2)
    assert boundary_compresses(t, (0, 2), (1, 2), 2) and boundary_compresses(t, (1, 2), (0, 2), 2)
    # Swarm wiring's links across replicas are judged alike.
    assert not boundary_compresses(t, (0, 0), (1, 1), 2)
    assert boundary_compresses(t, (1, 1), (0, 0), 2)
    # A group codes alike on every hop: if any link between two of its members is covered.
    assert group_compresses(t, 0, range(3), 2)  # (a dc member and a home one: 110 one way)
    assert not group_compresses(t, 0, range(2), 2)  # (replicas 0 and 1 of stage 0: both in the dc)
    assert group_compresses(t, 1, range(2), 2)
    assert not group_compresses(training({"below_mbps": 100}), 1, range(3), 2)  # (110 is not below)


def test_named_replicas_select_their_links_and_the_scope_says_which_compression():
    t = training({"replicas": [2]}, network=None)
    assert boundary_compresses(t, (0, 2), (1, 2), 2) and boundary_compresses(t, (1, 0), (0, 2), 2)
    assert not boundary_compresses(t, (0, 0), (1, 0), 2)
    assert not boundary_compresses(t, (0, 0), (1, 1), 2)
    assert group_compresses(t, 0, range(3), 2) and not group_compresses(t, 0, range(2), 2)
    only_boundary = training({"replicas": [2], "applies_to": ["boundary"]}, network=None)
    assert group_compresses(only_boundary, 0, range(2), 2)  # (the sync is not selected: everywhere)
    only_sync = training({"replicas": [2], "applies_to": ["sync"]}, network=None)
    assert boundary_compresses(only_sync, (0, 0), (1, 0), 2)
    # Without a rule, everywhere: today's behaviour.
    assert boundary_compresses(training(None), (0, 0), (1, 0), 2)
    assert group_compresses(training(None), 0, range(2), 2)


@pytest.mark.parametrize("rule, where, says", [
    ({}, "below_mbps", "give one of below_mbps and replicas"),
    ({"below_mbps": 10, "replicas": [1]}, "below_mbps", "give one of below_mbps and replicas"),
    ({"below_mbps": -1}, "below_mbps", "must be 0.001-1e+06"),
    ({"replicas": []}, "replicas", "must name 1-256 replicas"),
    ({"replicas": [1, 1]}, "replicas", "names a replica twice"),
    ({"replicas": [-1]}, "replicas", "replica indices are 0-255"),
    ({"replicas": [1], "applies_to": []}, "applies_to", "must list boundary, sync or both"),
    ({"replicas": [1], "applies_to": ["pipeline"]}, "applies_to", ""),
])
def test_a_bad_rule_is_one_line_naming_the_field(rule, where, says):
    with pytest.raises(SchemaError) as err:
        training(rule, network=None)
    text = str(err.value)
    assert text.startswith(f"$.compress_when{'.' + where if where else ''}")
    assert says in text and "\n" not in text


@pytest.mark.parametrize("model, rule, network, replicas, says", [
    ({}, {"below_mbps": 100}, None, 2, "below_mbps reads each link's rate from a link matrix"),
    ({}, {"replicas": [2]}, None, 2, "replicas names replica 2 of a job of 2 replicas (0-1)"),
    ({"compression": "learned_dim8"}, {"replicas": [1]}, None, 2,
     "cannot select links for 'learned_dim8'"),
    ({"compression": "subspace_k8"}, {"replicas": [0]}, None, 2, "cannot select links"),
])
def test_a_rule_the_job_cannot_use_is_refused_at_compress_when(model, rule, network, replicas,
                                                               says):
    mc = ModelConfig(d_model=32, n_heads=2, **model)
    err = job_shape_error(mc, training(rule, network, batch_size=8, micro_batches=2), 2,
                          replicas)
    assert err is not None and err[1] == "training.compress_when" and says in err[0]
    assert "\n" not in err[0]


def test_a_trained_boundary_may_have_its_sync_selected():
    mc = ModelConfig(d_model=32, n_heads=2, compression="learned_dim8")
    t = training({"replicas": [1], "applies_to": ["sync"]}, None, batch_size=8, micro_batches=2)
    assert job_shape_error(mc, t, 2, 2) is None


def test_the_byte_plans_count_each_link_in_its_own_format():
    mc = ModelConfig(d_model=32, n_heads=2, seq_len=16, compression="fixed_int8")
    t = training({"below_mbps": 200}, batch_size=12, micro_batches=2)
    plain = training({"below_mbps": 0.001}, batch_size=12, micro_batches=2)
    shape_elems = 2 * 16 * 32  # (a micro-batch of 12 / 3 replicas / 2)
    fp32, int8 = HEADER_SIZE + 4 * shape_elems, HEADER_SIZE + shape_elems + 4 * 2 * 16
    # Stage 0 of replica 1 sends activations at 500 Mbit/s (fp32), stage 1 gradients at 110.
    norms = expected_wire_bytes(mc, plain, 0, 2, 3, 1) - 2 * fp32
    assert expected_wire_bytes(mc, t, 0, 2, 3, 1) == 2 * fp32 + norms
    assert expected_wire_bytes(mc, t, 1, 2, 3, 1) == 2 * int8 + norms
    assert expected_wire_bytes(mc, t, 0, 2, 3, 2) == 2 * int8 + norms
    act, grad = step_boundary_bytes(mc, t, 2, 3)
    assert (act, grad) == (2 * (2 * fp32 + int8), 2 * (fp32 + 2 * int8))
    assert step_wire_bytes(mc, t, 2, 3) == act + grad + 6 * norms


MODEL = dict(d_model=32, n_layers=2, n_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _run(mc: ModelConfig, tc: TrainingConfig, data) -> dict[int, StageResult]:
    res = run_local_pipeline(mc, tc, data, 2, replicas=2, timeout=120)
    failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
    assert not failed, failed
    return res  # type: ignore[return-value]


def test_a_job_whose_rule_covers_no_link_computes_the_uncompressed_job(data):
    """int8 at the boundary and in the sync, but every link is above the rate: each link
    sends fp32, and the 2 x 2 job computes one process's uncompressed losses to 1e-5."""
    mc = ModelConfig(**MODEL, compression="fixed_int8")
    net = {"sites": {"a": {}, "b": {}}, "links": {"a": {"b": {"mbps": 1000}}}}
    tc = training({"below_mbps": 10}, net, steps=8, batch_size=8, micro_batches=2,
                  eval_batches=0, sync={"compression": "int8"})
    res = _run(mc, tc, data)
    ref, _ = train_reference(ModelConfig(**MODEL), tc, data, split_layers(2, [1, 1]))
    got = [(a + b) / 2 for a, b in zip(res[1].losses, res[3].losses, strict=True)]
    assert len(got) == 8 and max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    for r in res.values():
        m = r.metrics
        assert m.link_codecs is not None and set(m.link_codecs.values()) == {"fp32"}
        assert m.peer_links and all(p.codec == "fp32" for p in m.peer_links)
        assert m.wire_tx_bytes_per_step == m.expected_wire_tx_bytes_per_step
        assert m.sync_tx_bytes_per_step == m.expected_sync_tx_bytes_per_step


def test_a_covered_link_sends_fewer_bytes_and_only_it(data):
    """Replica 0 in one site, replica 1's stages at two others 50 Mbit/s apart, and stage 1's
    group across a 50 Mbit/s link too: replica 1's boundary and stage 1's sync go in int8,
    replica 0's boundary and stage 0's sync in fp32."""
    mc = ModelConfig(**MODEL, compression="fixed_int8")
    net = {"sites": {"a": {}, "b": {}, "c": {}},
           "links": {"a": {"b": {"mbps": 1000}, "c": {"mbps": 50}}, "b": {"c": {"mbps": 50}}},
           "cell_sites": [["a", "a"], ["b", "c"]]}
    tc = training({"below_mbps": 100}, net, steps=4, batch_size=8, micro_batches=2,
                  eval_batches=1, sync={"compression": "int8"})
    res = _run(mc, tc, data)
    m = {(cell % 2, cell // 2): r.metrics for cell, r in res.items()}  # (stage, replica)
    assert m[0, 0].link_codecs == {"1.0": "fp32", "0.1": "fp32"}
    assert m[1, 0].link_codecs == {"0.0": "fp32", "1.1": "int8"}
    assert m[0, 1].link_codecs == {"1.1": "int8", "0.0": "fp32"}
    assert m[1, 1].link_codecs == {"0.1": "int8", "1.0": "int8"}
    for (stage, replica), cell in m.items():
        assert cell.wire_tx_bytes_per_step == cell.expected_wire_tx_bytes_per_step \
            == expected_wire_bytes(mc, tc, stage, 2, 2, replica)
        assert cell.sync_tx_bytes_per_step == cell.expected_sync_tx_bytes_per_step
        assert cell.peer_links and all(p.codec == cell.link_codecs[p.peer]
                                       for p in cell.peer_links)
    # The covered boundary sends about a quarter of the other chain's bytes.
    assert m[0, 1].wire_tx_bytes_per_step < 0.4 * m[0, 0].wire_tx_bytes_per_step
    assert m[1, 1].wire_tx_bytes_per_step < 0.4 * m[1, 0].wire_tx_bytes_per_step
    # Per pair: 0.1 -> 1.1 moved int8, 0.0 -> 1.0 fp32 (4 steps and an evaluation).
    pair = {(cell, p.peer): p.tx_bytes for cell, x in m.items() for p in x.peer_links or ()}
    assert pair[(0, 1), "1.1"] < 0.4 * pair[(0, 0), "1.0"]
    # Stage 1's ring codes int8, stage 0's fp32 (a ring of 2 sends each member's whole
    # stage once a step: 4 bytes an element, or 1 and the scales).
    sizes = [sum(p.numel() for p in StageModule(mc, data.vocab_size, 0, a, b, s, 2).parameters())
             for s, (a, b) in enumerate(split_layers(2, [1, 1]))]
    assert m[0, 0].sync_tx_bytes_per_step >= 4 * sizes[0]
    assert m[1, 0].sync_tx_bytes_per_step < 1.5 * sizes[1]
    assert all(r.losses == [] or r.losses[-1] < r.losses[0] + 0.5 for r in res.values())


def test_swarm_wiring_picks_each_routed_links_codec(data):
    """Routed micro-batches cross between replicas: a link touching replica 1 codes int8,
    replica 0's own chain fp32, on whichever link the step's route sends a micro-batch."""
    mc = ModelConfig(**MODEL, compression="fixed_int8")
    tc = training({"replicas": [1]}, None, steps=3, batch_size=8, micro_batches=2,
                  eval_batches=1)
    res = run_local_pipeline(mc, tc, data, 2, replicas=2, timeout=120, wiring="swarm",
                             route_weights=[[3.0, 1.0], [1.0, 3.0]])
    assert all(isinstance(r, StageResult) for r in res.values()), res
    m = {(cell % 2, cell // 2): r.metrics for cell, r in res.items()}  # (stage, replica)
    assert m[0, 0].link_codecs == {"1.0": "fp32", "1.1": "int8", "0.1": "fp32"}
    assert m[1, 1].link_codecs == {"0.0": "int8", "0.1": "int8", "1.0": "fp32"}
    ref, _ = train_reference(ModelConfig(**MODEL), tc, data, split_layers(2, [1, 1]))
    # (each replica's loss the mean over the micro-batches its route gave it: weighted)
    got = [step_loss({0: a, 1: b}, {0: m, 1: n}) for a, b, m, n in zip(
        res[1].losses, res[3].losses, res[1].micro_batches, res[3].micro_batches,
        strict=True)]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 5e-2


def test_a_layout_cell_names_what_it_sends_each_of_its_peers_by_their_sites():
    """Under a layout [[0, 1], [0, 1, 2]] stage 0's cell 1 may send to any of stage 1's three
    cells, the extra id 2 too, each link coded as its sites' rate says; stage 1's cells
    sync around a ring of their own ids (cell 1 to 2, cell 2 to 0), in the group's one
    format, which its own cells' links decide: id 2 sits 50 Mbit/s from ids 0 and 1, so the
    group codes int8 (stage 0's two cells, 1000 Mbit/s apart, fp32). Each cell sits where
    the placement put it: the replica rule names id 2's site."""
    from swarm_core.contract.placement import FellowSlots, plan
    from swarm_core.pipeline.boundary import make_boundary
    from swarm_core.pipeline.selective import LinkCodecs
    from swarm_core.pipeline.stage import StageSpec

    mc = ModelConfig(**MODEL, compression="fixed_int8")
    net = {"sites": {"a": {}, "b": {}, "c": {}},
           "links": {"a": {"b": {"mbps": 1000}, "c": {"mbps": 50}}, "b": {"c": {"mbps": 50}}},
           "replica_sites": ["a", "b", "c"]}
    tc = training({"below_mbps": 100}, net, batch_size=8, micro_batches=2,
                  sync={"compression": "int8"})
    layout = [[0, 1], [0, 1, 2]]
    placed = plan([FellowSlots(i, f"f{i}", ["cpu"], f"127.0.0.1:{9000 + i}")
                   for i in range(5)], 2, 2, replicas=2, layout=layout, network=tc.network)

    def sent(stage: int, cell: int) -> dict[str, str]:
        spec = StageSpec("j", "k", stage, 2, (stage, stage + 1), None, mc, tc, replica=cell,
                         replicas=2, wiring="swarm", layout=layout, placement=placed)
        return LinkCodecs(spec, make_boundary(mc)).sent()

    assert sent(0, 1) == {"1.0": "fp32", "1.1": "fp32", "1.2": "int8", "0.0": "fp32"}
    assert sent(1, 1) == {"0.0": "fp32", "0.1": "fp32", "1.2": "int8"}
    assert sent(1, 2) == {"0.0": "int8", "0.1": "int8", "1.0": "int8"}


def test_a_group_a_moved_peer_joins_codes_by_the_peers_own_site():
    """Stage 1's three cells share a site; stage 0's cell 2 sits at a home 50 Mbit/s away.
    Its group syncs fp32 (no slow link inside it) until rebalancing moves stage 0's cell 2
    to stage 1 as cell 3: the group, re-formed, now spans the slow link and codes int8, the
    moved peer judged at its own site (the placement's; the cell rule names none for id 3)."""
    from swarm_core.contract.placement import FellowSlots, plan

    net = {"sites": {"a": {}, "c": {}}, "links": {"a": {"c": {"mbps": 50}}},
           "cell_sites": [["a", "a"], ["a", "a"], ["c", "a"]]}
    t = training({"below_mbps": 100, "applies_to": ["sync"]}, net)
    placed = plan([FellowSlots(i, f"f{i}", ["cpu"], f"127.0.0.1:{9000 + i}")
                   for i in range(6)], 2, 2, replicas=3, network=t.network)
    assert not group_compresses(t, 1, [0, 1, 2], 2, placed)
    moved = placed.moved(0, 2, 1, 3)
    assert group_compresses(t, 1, [0, 1, 2, 3], 2, moved)
    assert not group_compresses(t, 0, [0, 1], 2, moved)
