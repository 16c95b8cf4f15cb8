"""One stage of a pipeline job on one fellow: links, schedule, optimiser step, evaluation.

Runs in a thread of its own (torch releases the GIL), so the fellow's asyncio loop keeps
heartbeating while the stage computes.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import CodecErrors, StageMetrics, StageStart, perplexity
from swarm_core.data import TokenData
from swarm_core.pipeline import codecs
from swarm_core.pipeline.devices import resolve_device
from swarm_core.pipeline.frames import FLAG_EVAL, Kind, job_tag
from swarm_core.pipeline.heap import keep_large_blocks
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.listener import DataListener
from swarm_core.pipeline.memory import ActivationMeter
from swarm_core.pipeline.model import StageModule, dropout_rng, lm_loss
from swarm_core.pipeline.optim import (
    OptimizerStateError,
    clip_scale,
    grad_sq_sum,
    load_optimizer_arrays,
    lr_at,
    make_optimizer,
    scale_grads,
    set_lr,
)
from swarm_core.pipeline.schedules import hurried_backwards, ops_for
from swarm_core.pipeline.transport import Liveness, PeerLink, connect
from swarm_core.pipeline.wgrad import WeightGradQueue, attach
from swarm_core.pipeline.wire_math import (
    NORM_PAYLOAD,
    WireFormat,
    boundary_width,
    expected_wire_bytes,
)

# The activation meter hooks every tensor autograd saves, in Python: ~2 ms a micro-batch on the
# bench model (1-2 % of a step; a quarter of a tiny model's). What a step holds is set by the
# shapes and the schedule, and only deferred W passes (which fill waits) move it, so the meter
# runs on a runner's first step and every METER_EVERY-th; the steps between repeat its peak.
METER_EVERY = 10

# A stage whose compute thread shows no progress (an op begun, a wait polled) for this many frame
# timeouts stops pulsing its links, so its neighbours time out: long enough for any checkpoint
# (a shard write is seconds), short of for ever for a call hung on a disk or a device.
STUCK_AFTER = 10
# How long a stage may take to load its data and build its model once its links are up, in
# frame timeouts (an hour by default): a cold BPE tokenizer on a large corpus takes minutes.
PREPARE_AFTER = 60


class StageStopped(Exception):
    """The leader said STOP (or the job was cancelled)."""


@attrs.define
class StepReport:
    step: int  # 1-based: steps completed
    loss: float | None
    seconds: float
    tokens: int
    wire_tx_bytes: int
    lr: float
    # Peak bytes held for backward during the latest metered step (see METER_EVERY).
    activation_peak_bytes: int = 0
    # Of ``seconds``, the time the stage sat blocked on its links: waiting for a neighbour's
    # frame (its compute, the network, the pipeline's bubble) or for its own sends to drain.
    wait_seconds: float = 0.0
    # Relative L2 error the wire codec put on what this stage sent, micro-batch 0: "act"
    # (activations downstream) and "grad" (gradients upstream); 0 on an fp32 wire.
    codec_error: CodecErrors = attrs.field(factory=CodecErrors)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def figures(self) -> StageMetrics:
        """What the stage reports of this step."""
        return StageMetrics(wire_tx_bytes=self.wire_tx_bytes, step_seconds=self.seconds,
                            lr=self.lr, activation_peak_bytes=self.activation_peak_bytes,
                            wait_seconds=self.wait_seconds, codec_error=self.codec_error)

    @property
    def wait_fraction(self) -> float:
        return _ratio(self.wait_seconds, self.seconds)


class ResumeError(ValueError):
    """The checkpoint a stage was asked to resume from does not fit it."""


@attrs.define
class StageSpec:
    job_id: str
    key: str
    stage: int
    num_stages: int
    layers: tuple[int, int]
    downstream_addr: str | None
    model: ModelConfig
    training: TrainingConfig
    device: str = "cpu"
    # The neighbour upstream / downstream runs in this same fellow (another device slot): that
    # link never leaves the machine, so the fellow's link shaping and counters leave it out.
    local_up: bool = False
    local_down: bool = False

    @property
    def reads_tokens(self) -> bool:
        """Inputs go to the first stage and targets to the last; those between read none."""
        return self.stage in (0, self.num_stages - 1)

    @classmethod
    def from_start(cls, start: StageStart, threads: int | None = None) -> StageSpec:
        """The stage a train START describes. ``threads``: what this fellow's machine gives a
        stage (the job's own number is for the single-process reference)."""
        training = start.train
        assert training is not None and start.model is not None, "a train START"
        if threads is not None:
            training = attrs.evolve(training, threads=threads)
        mine = start.mine
        return cls(job_id=start.job_id, key=start.key, stage=start.stage,
                   num_stages=start.num_stages, layers=mine.layers.as_tuple(),
                   downstream_addr=start.downstream_addr, model=start.model, training=training,
                   device=mine.device, local_up=start.local_up, local_down=start.local_down)


def frame_shape(spec: StageSpec) -> tuple[int, int, int]:
    """Every ACT and GRAD frame at a stage's boundaries: one micro-batch, boundary-wide."""
    t, m = spec.training, spec.model
    return (t.batch_size // t.micro_batches, m.seq_len, boundary_width(m))


def open_links(spec: StageSpec, shaper: LinkShaper, listener: DataListener | None,
               stop: threading.Event, timeout: float, liveness: Liveness
               ) -> tuple[PeerLink | None, PeerLink | None]:
    """Dial the next stage and take the previous one's dial: (up, down). ``shaper`` shapes
    and counts the links that leave the fellow; a link to a stage in the same fellow
    (``spec.local_up``/``local_down``) gets an unshaped one of its own."""
    m, t = spec.model, spec.training
    # A frame from a neighbour is at most one boundary tensor (or a norm): a header that
    # claims more is refused before its buffer is allocated.
    limit = max(WireFormat.of(m).payload_size(frame_shape(spec)), NORM_PAYLOAD)
    # A link left idle for a quarter of the frame timeout gets a pulse: a neighbour waits out
    # our checkpoint or our wait on the stage beyond, not our death, a frozen process or a
    # compute thread that has shown no progress for STUCK_AFTER frame timeouts.
    pulse = t.frame_timeout_s / 4
    tag = job_tag(spec.job_id)
    up = down = None
    try:
        if spec.stage < spec.num_stages - 1:
            assert spec.downstream_addr is not None
            down = connect(spec.downstream_addr, spec.key, spec.stage, tag,
                           LinkShaper() if spec.local_down else shaper, timeout, abort=stop,
                           max_payload=limit, receives=(Kind.GRAD, Kind.NORM),
                           pulse_s=pulse, liveness=liveness)
        if spec.stage > 0:
            assert listener is not None
            up = listener.accept(spec.key, spec.stage, tag,
                                 LinkShaper() if spec.local_up else shaper, timeout, abort=stop,
                                 max_payload=limit, receives=(Kind.ACT, Kind.NORM),
                                 pulse_s=pulse, liveness=liveness)
    except BaseException:
        if down is not None:
            down.close()
        raise
    return up, down


class _LinkOpener:
    """``open_links`` in a thread of its own, begun before the stage loads its data and builds
    its model, so the neighbours are linked however long each stage takes to prepare, instead
    of timing out on a dial that a slow tokenizer held back. Until the stage takes the links,
    preparing counts as progress (its links pulse), for up to PREPARE_AFTER frame timeouts."""

    def __init__(self, spec: StageSpec, shaper: LinkShaper, listener: DataListener | None,
                 stop: threading.Event, timeout: float, liveness: Liveness) -> None:
        self._links: tuple[PeerLink | None, PeerLink | None] | None = None
        self._error: BaseException | None = None
        self._taken = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(spec, shaper, listener, stop, timeout, liveness),
            name="stage-links", daemon=True)
        self._thread.start()

    def _run(self, spec: StageSpec, shaper: LinkShaper, listener: DataListener | None,
             stop: threading.Event, timeout: float, liveness: Liveness) -> None:
        try:
            self._links = open_links(spec, shaper, listener, stop, timeout, liveness)
        except BaseException as exc:  # handed to the stage's thread by result()
            self._error = exc
            return
        frame_timeout = spec.training.frame_timeout_s
        until = time.monotonic() + PREPARE_AFTER * frame_timeout
        while not self._taken.wait(min(1.0, frame_timeout / 8)) and time.monotonic() < until:
            liveness.touch()

    def result(self) -> tuple[PeerLink | None, PeerLink | None]:
        self._taken.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._links is not None
        return self._links

    def discard(self) -> None:
        """After the stage failed first: wait for the thread (its dial or accept ends on the
        stage's stop) and close whatever it opened."""
        self._taken.set()
        self._thread.join()
        for link in self._links or ():
            if link is not None:
                link.close()


class StageRunner:
    def __init__(self, spec: StageSpec, data: TokenData, shaper: LinkShaper,
                 stop: threading.Event, liveness: Liveness | None = None) -> None:
        keep_large_blocks()  # per-micro-batch tensors reuse warm pages (see heap.py)
        self.spec = spec
        self.data = data
        self.shaper = shaper
        self.stop = stop
        m = spec.model
        vocab = m.vocab_size or data.vocab_size
        self.device = resolve_device(spec.device, m.dtype)
        # Built on the CPU under the part seeds, then moved: the same weights on any device.
        self.module = StageModule(m, vocab, spec.training.seed, spec.layers[0], spec.layers[1],
                                  spec.stage, spec.num_stages).to(self.device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.meter = ActivationMeter(self.module.parameters())
        self.first = spec.stage == 0
        self.last = spec.stage == spec.num_stages - 1
        t = spec.training
        self.ops = ops_for(t.schedule, spec.stage, spec.num_stages, t.micro_batches)
        # Split backward only where it pays (see hurried_backwards): none on the first stage of
        # GPipe, whose Linears then stay plain.
        self.hurried = hurried_backwards(self.ops, self.first) \
            if t.split_backward and spec.num_stages > 1 else frozenset()
        self.wgrad: WeightGradQueue | None = None
        if self.hurried:
            self.wgrad = WeightGradQueue(self.meter)
            attach(self.module, self.wgrad)
        # Deferred W passes hold a micro-batch's layer inputs and output gradients each; beyond
        # this many the stage runs one at once (memory stays in 1F1B's class).
        self.max_deferred = max(2, spec.num_stages)
        self.opt = make_optimizer(self.module, spec.training)
        self.codec = codecs.WireCodec.of(m)
        self.metered_steps = 0  # steps the activation meter ran on (see METER_EVERY)
        self.frame_shape = frame_shape(spec)
        self.up: PeerLink | None = None
        self.down: PeerLink | None = None
        self.liveness = liveness or Liveness(STUCK_AFTER * spec.training.frame_timeout_s)

    # links -----------------------------------------------------------------------------------

    def sent(self) -> int:
        """Bytes this stage's own links sent (a fellow may run several stages)."""
        return sum(link.sent for link in (self.up, self.down) if link is not None)

    def waited(self) -> float:
        """Seconds this stage has spent blocked on its links."""
        return sum(link.waited for link in (self.up, self.down) if link is not None)

    def close(self) -> None:
        for link in (self.up, self.down):
            if link is not None:
                link.close()

    # training --------------------------------------------------------------------------------
    def _check_stop(self) -> None:
        self.liveness.touch()  # before every op: the compute thread is moving
        if self.stop.is_set():
            raise StageStopped()

    def train_step(self, step: int) -> StepReport:
        """Global step ``step`` (0-based): all micro-batches, clip, one optimiser step."""
        t = self.spec.training
        m = t.micro_batches
        timeout = t.frame_timeout_s
        tx0, wait0 = self.sent(), self.waited()
        t0 = time.perf_counter()
        lr = lr_at(step, t)
        set_lr(self.opt, lr)
        self.module.train()
        # Token ids go to the device of the stage that reads them: inputs first, targets last
        # (the stages between read none, and may hold no tokens at all).
        xs: tuple[torch.Tensor, ...] = ()
        ys: tuple[torch.Tensor, ...] = ()
        if self.spec.reads_tokens:
            x, y = self.data.batch(step, t.batch_size, self.spec.model.seq_len, t.seed)
            xs = x.to(self.device).chunk(m) if self.first else ()
            ys = y.to(self.device).chunk(m) if self.last else ()
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        held: dict[int, Any] = {}  # the meter's tokens for outputs kept until their backward
        metered = self.metered_steps == 0 or step % METER_EVERY == 0
        if metered:
            self.meter.start_step()
            self.metered_steps += 1
        saving = self.meter.saving if metered else contextlib.nullcontext
        loss_sum = 0.0
        errors = CodecErrors()
        wq = self.wgrad
        # Nothing carries over from a step that did not finish: no pending weight passes, no
        # gradients half accumulated.
        self.opt.zero_grad(set_to_none=True)
        if wq is not None:
            wq.clear()
            wq.meter = self.meter if metered else None
        for op, i in self.ops:
            self._check_stop()
            if op == "F":
                if self.first:
                    inp = xs[i]
                else:
                    assert self.up is not None
                    self._fill_wait(self.up, Kind.ACT)
                    _, inp = self.up.recv_tensor(Kind.ACT, step, i, timeout, self.device,
                                                 self.frame_shape)
                    inp.requires_grad_(True)
                    inputs[i] = inp
                if wq is not None:
                    wq.splitting = i in self.hurried  # (the rest train as plain Linears)
                with dropout_rng(self.module, step, i), saving():
                    out = self.module(inp)
                    if self.last:  # the loss's saved log-probabilities count too
                        loss = lm_loss(out, ys[i]) / m
                if self.last:
                    loss_sum += float(loss.detach())
                    outputs[i] = loss
                else:
                    assert self.down is not None
                    self.down.send_tensor(Kind.ACT, step, i, out, self.codec)
                    if i == 0:  # (once per step and direction: one more quantisation in m)
                        errors.act = self.codec.relative_error(out)
                    outputs[i] = out
                    if metered:
                        held[i] = self.meter.hold(out)
            else:
                grad = None
                if not self.last:
                    assert self.down is not None
                    self._fill_wait(self.down, Kind.GRAD)
                    _, grad = self.down.recv_tensor(Kind.GRAD, step, i, timeout, self.device,
                                                    self.frame_shape)
                hurry = wq is not None and i in self.hurried
                if wq is not None and not hurry:
                    # A fused backward (its forward ran plain): the pending W passes first,
                    # so gradients still add up in micro-batch order.
                    wq.drain()
                with wq.capture() if hurry else contextlib.nullcontext():
                    outputs.pop(i).backward(grad)
                held.pop(i, None)
                if not self.first:
                    assert self.up is not None
                    inp = inputs.pop(i)
                    assert inp.grad is not None
                    self.up.send_tensor(Kind.GRAD, step, i, inp.grad, self.codec)
                    if i == 0:
                        errors.grad = self.codec.relative_error(inp.grad)
                if wq is not None and len(wq) > self.max_deferred:
                    wq.run_batch()
        if wq is not None:
            wq.drain()
        if t.grad_clip > 0:
            scale_grads(self.params, clip_scale(self._global_sq(step), t.grad_clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for link in (self.up, self.down):
            if link is not None:
                link.flush(timeout)
        seconds = time.perf_counter() - t0
        return StepReport(step=step + 1, loss=loss_sum if self.last else None, seconds=seconds,
                          tokens=t.batch_size * self.spec.model.seq_len,
                          wire_tx_bytes=self.sent() - tx0, lr=lr,
                          activation_peak_bytes=self.meter.peak,
                          wait_seconds=self.waited() - wait0, codec_error=errors)

    def _fill_wait(self, link: PeerLink, kind: Kind) -> None:
        """Before blocking on a frame, spend the wait on deferred W passes."""
        wq = self.wgrad
        if wq is None:
            return
        while not link.ready(kind) and wq.run_one():
            self._check_stop()

    def _global_sq(self, step: int) -> float:
        """Sum of squared gradients over every stage: up the pipe, then the total back down."""
        local = grad_sq_sum(self.params)
        if self.spec.num_stages == 1:
            return local
        timeout = self.spec.training.frame_timeout_s
        below = 0.0
        if not self.last:
            assert self.down is not None
            below = self.down.recv_float(Kind.NORM, step, 0, timeout)
        if not self.first:
            assert self.up is not None
            self.up.send_float(Kind.NORM, step, 0, local + below)
            total = self.up.recv_float(Kind.NORM, step, 1, timeout)
        else:
            total = local + below
        if not self.last:
            assert self.down is not None
            self.down.send_float(Kind.NORM, step, 1, total)
        return total

    @torch.no_grad()
    def evaluate(self, step: int) -> float | None:
        """Validation loss on the fixed held-out batches (the last stage returns it)."""
        t = self.spec.training
        if t.eval_batches == 0:
            return None
        self.module.eval()
        timeout = t.frame_timeout_s
        mb = t.batch_size // t.micro_batches
        batches: list[tuple[Any, Any]] = \
            self.data.eval_batches(t.eval_batches, mb, self.spec.model.seq_len) \
            if self.spec.reads_tokens else [(None, None)] * t.eval_batches
        total = 0.0
        for i, (x, y) in enumerate(batches):
            self._check_stop()
            if self.first:
                inp = x.to(self.device)
            else:
                assert self.up is not None
                _, inp = self.up.recv_tensor(Kind.ACT, step, 1_000_000 + i, timeout,
                                             self.device, self.frame_shape, FLAG_EVAL)
            out = self.module(inp)
            if self.last:
                total += float(lm_loss(out, y.to(self.device)))
            else:
                assert self.down is not None
                self.down.send_tensor(Kind.ACT, step, 1_000_000 + i, out, self.codec,
                                      flags=FLAG_EVAL)
        for link in (self.up, self.down):
            if link is not None:
                link.flush(timeout)
        return total / len(batches) if self.last else None


@attrs.define
class StageResult:
    """What a stage's run ends with: its figures for the leader, and its losses by step (the
    last stage's; empty elsewhere) for tests and benchmarks."""

    metrics: StageMetrics
    losses: list[float] = attrs.field(factory=list)


def run_stage(spec: StageSpec, data: TokenData | Callable[[], TokenData], shaper: LinkShaper,
              listener: DataListener | None, stop: threading.Event,
              on_step: Callable[[StepReport], None],
              on_eval: Callable[[int, float], None] | None = None,
              connect_timeout: float = 60.0,
              on_checkpoint: Callable[[int, StageModule, torch.optim.Optimizer], None]
              | None = None,
              start_step: int = 0,
              initial_state: dict[str, torch.Tensor] | None = None,
              initial_optimizer: dict[str, np.ndarray] | None = None) -> StageResult:
    """Train all steps of one stage; returns its final figures (loss and eval on the last).

    ``on_checkpoint(step, module, optimizer)`` runs every ``shard_push_interval_steps`` and
    after the last step, between optimiser steps, so it sees consistent weights and state.
    ``initial_state`` and ``initial_optimizer`` (from a checkpoint at ``start_step``) resume a
    run: with both, the steps after it are bit for bit those of the uninterrupted run (dropout
    masks depend on the seed, stage, step and micro-batch alone). A checkpoint that does not fit
    this stage raises :class:`ResumeError`.

    ``data`` may be a loader, called in this thread once the links are being opened (a BPE
    tokenizer trained on a cold cache can take longer than the neighbours' dial timeout; the
    links pulse meanwhile, for up to PREPARE_AFTER frame timeouts).
    A stage that fails before its links are up sets ``stop``, which ends their dial."""
    torch.set_num_threads(spec.training.threads)
    liveness = Liveness(STUCK_AFTER * spec.training.frame_timeout_s)
    opener = _LinkOpener(spec, shaper, listener, stop, connect_timeout, liveness)
    try:
        runner = StageRunner(spec, data() if callable(data) else data, shaper, stop, liveness)
        _restore(runner, initial_state, initial_optimizer)
    except BaseException:
        stop.set()
        opener.discard()
        raise
    try:
        runner.up, runner.down = opener.result()
        return _train(runner, on_step, on_eval, on_checkpoint, start_step)
    finally:
        runner.close()


def _restore(runner: StageRunner, state: dict[str, torch.Tensor] | None,
             optimizer: dict[str, np.ndarray] | None) -> None:
    try:
        if state is not None:
            runner.module.load_state_dict(state, strict=True)
        if optimizer is not None:
            load_optimizer_arrays(runner.opt, runner.module, optimizer)
    except (RuntimeError, OptimizerStateError) as exc:
        # load_state_dict lists every missing and unexpected key: the first line says enough.
        raise ResumeError(str(exc).strip().splitlines()[0]) from None


def _train(runner: StageRunner, on_step: Callable[[StepReport], None],
           on_eval: Callable[[int, float], None] | None,
           on_checkpoint: Callable[[int, StageModule, torch.optim.Optimizer], None] | None,
           start_step: int) -> StageResult:
    t = runner.spec.training
    reports: list[StepReport] = []
    t0 = time.perf_counter()
    for step in range(start_step, t.steps):
        rep = runner.train_step(step)
        reports.append(rep)
        on_step(rep)
        every = t.shard_push_interval_steps
        if on_checkpoint is not None and every and rep.step % every == 0 and rep.step != t.steps:
            on_checkpoint(rep.step, runner.module, runner.opt)
        if t.eval_every and rep.step % t.eval_every == 0 and rep.step != t.steps:
            ev = runner.evaluate(rep.step)
            if ev is not None and on_eval is not None:
                on_eval(rep.step, ev)
    eval_loss = runner.evaluate(t.steps)
    wall = time.perf_counter() - t0
    if on_checkpoint is not None:
        on_checkpoint(t.steps, runner.module, runner.opt)
    result = _summary(runner.spec, reports, wall, start_step)
    if eval_loss is not None:
        result.metrics.eval_loss, result.metrics.perplexity = eval_loss, perplexity(eval_loss)
        if on_eval is not None:
            on_eval(t.steps, eval_loss)
    return result


def _summary(spec: StageSpec, reports: list[StepReport], wall: float,
             start_step: int) -> StageResult:
    t = spec.training
    losses = [r.loss for r in reports if r.loss is not None]
    # Link waits of steps that follow a start, an eval or a shard push are partly the
    # neighbours' own pause; the run's share leaves them out (all of them: a short run).
    steady = [r for r in reports if not t.follows_a_pause(r.step, start_step)] or reports

    def mean_error(direction: str) -> float | None:
        values = [getattr(r.codec_error, direction) for r in reports]
        return statistics.fmean(values) if values and values[0] is not None else None

    metrics = StageMetrics(
        steps=len(reports), wall_s=wall,
        tokens_per_s=sum(r.tokens for r in reports) / wall if wall > 0 else 0.0,
        wire_tx_bytes_per_step=(sum(r.wire_tx_bytes for r in reports) / len(reports)
                                if reports else 0.0),
        expected_wire_tx_bytes_per_step=expected_wire_bytes(
            spec.model, t, spec.stage, spec.num_stages),
        activation_peak_bytes=max((r.activation_peak_bytes for r in reports), default=0),
        wait_fraction=_ratio(sum(r.wait_seconds for r in steady),
                             sum(r.seconds for r in steady)),
        codec_error=CodecErrors(act=mean_error("act"), grad=mean_error("grad")))
    if losses:
        metrics.final_loss, metrics.best_loss = losses[-1], min(losses)
    return StageResult(metrics, losses)


def _ratio(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0
