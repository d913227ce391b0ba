"""The pipeline's point-to-point exchanges and what a stage holds, on one process.

Each stage of a pipeline runs in a thread of this process on a fabric with NCCL's
point-to-point rules (``Fabric``): a rank's batch (one ``batch_isend_irecv``, NCCL's group)
completes when every message in it has met its peer's; the k-th send of a directed pair meets
only the k-th receive of that pair, whatever the tags, and only while both batches are posted
(no buffering); a rank waits for its batch before it goes on. A circular wait stops every
thread (``Deadlock``). The stages are a chain of virtual stages j = chunk x pp + stage, each
multiplying its input by a weight and by an activation autograd keeps for the backward, so a
message that reaches the wrong receiver changes what the receiver computes: each forward checks
its input and each backward the gradient it was sent against a one-process reference.

toolkit.runtime.pipeline.run_pipeline runs on it for every schedule the planner proposes at
small sizes (pp 2-4, vpp 1-4, micro-batches up to 4 pp; interleaved only with a multiple of pp:
rules.interleaved_microbatches), and so do megatron-core's own schedule functions with its
P2PCommunicator (its ``_communicate`` and ``_batched_p2p_ops`` as they are, their
``batch_isend_irecv`` posting on the fabric; megatron's ``backward_step`` with
deallocate_pipeline_outputs; only ``forward_step`` is the chain's). Both must post the same
batches, and a stage must hold megatron's and the planner's number of micro-batches in flight.
"""
from __future__ import annotations

import math
import threading
import weakref
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from toolkit.runtime.pipeline import P2P, run_pipeline

SHAPE = (3, 1, 2)  # [s, b, h] of every message
SIZE = math.prod(SHAPE)


class Deadlock(Exception):
    """A replayed posting order in which every rank waits on a message no rank sends."""


class Fabric:
    """NCCL's point-to-point semantics between n ranks, one thread each (module docstring)."""

    def __init__(self, n: int):
        self.n, self.cv = n, threading.Condition()
        self.posted: list[list | None] = [None] * n  # the batch each rank waits for
        self.finished = [False] * n
        self.counts: dict = {}  # (send?, src, dst) -> messages posted so far
        self.batches: list[list] = [[] for _ in range(n)]  # per rank, each batch's (send|recv, peer)
        self.stuck: str | None = None

    def post(self, rank: int, ops: list[tuple[str, int, torch.Tensor]]) -> None:
        with self.cv:
            batch = []
            for role, peer, t in ops:
                send = role.startswith("send")
                key = (send, rank, peer) if send else (send, peer, rank)
                index = self.counts.get(key, 0)
                self.counts[key] = index + 1
                batch.append({"pair": key[1:], "index": index, "send": send, "tensor": t, "done": False})
            self.batches[rank].append(sorted((role[:4], peer) for role, peer, _ in ops))
            self.posted[rank] = batch
            self._match()
            while not all(op["done"] for op in batch):
                if self.stuck is None and self._all_waiting():
                    self.stuck = f"circular wait: {self._waiting()}"
                    self.cv.notify_all()
                if self.stuck is not None:
                    raise Deadlock(self.stuck)
                self.cv.wait()
            self.posted[rank] = None

    def finish(self, rank: int) -> None:
        with self.cv:
            self.finished[rank] = True
            self.cv.notify_all()

    def _match(self) -> None:
        open_ops = [op for batch in self.posted if batch for op in batch if not op["done"]]
        sends = {(op["pair"], op["index"]): op for op in open_ops if op["send"]}
        for recv in (op for op in open_ops if not op["send"]):
            send = sends.get((recv["pair"], recv["index"]))
            if send is not None:
                with torch.no_grad():
                    recv["tensor"].copy_(send["tensor"])
                send["done"] = recv["done"] = True
                self.cv.notify_all()

    def _all_waiting(self) -> bool:
        return all(self.finished[r] or (self.posted[r] is not None and not all(op["done"] for op in self.posted[r]))
                   for r in range(self.n))

    def _waiting(self) -> dict:
        return {r: [(op["pair"], op["index"]) for op in b if not op["done"]] for r, b in enumerate(self.posted) if b}


def run_ranks(n: int, body) -> None:
    """body(rank) in one thread per rank; the first error (a deadlock last) is raised."""
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            body(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    errors.sort(key=lambda e: isinstance(e, Deadlock))
    if errors:
        raise errors[0]


class Chain:
    """pp x vpp virtual stages; stage j: y = x * w_j * a_j,mb with a_j,mb kept by autograd (the
    stage's activations); the last: loss = sum(y * target_mb). ``inputs[j][mb]`` and
    ``grads[j][mb]``: what virtual stage j must receive for micro-batch mb, from a one-process
    reference; ``w_grad``: the weights' gradients over the step (each loss / m)."""

    def __init__(self, pp: int, vpp: int, m: int):
        g = torch.Generator().manual_seed(pp * 100 + vpp * 10 + m)
        self.pp, self.vpp, self.m, self.stages = pp, vpp, m, pp * vpp
        self.w = 1 + 0.1 * torch.randn(self.stages, generator=g)
        self.acts = 1 + 0.1 * torch.randn(self.stages, m, *SHAPE, generator=g)
        self.data = torch.randn(m, *SHAPE, generator=g)
        self.target = torch.randn(m, *SHAPE, generator=g)
        w = self.w.clone().requires_grad_()
        self.inputs = [[None] * m for _ in range(self.stages)]
        total, self.losses = 0, []
        for mb in range(m):
            x = self.data[mb]
            for j in range(self.stages):
                self.inputs[j][mb] = x
                x = x * w[j] * self.acts[j, mb]
                x.retain_grad()
            loss = (x * self.target[mb]).sum()
            self.losses.append(loss.detach())
            total = total + loss / m
        total.backward()
        self.grads = [[self.inputs[j + 1][mb].grad if j + 1 < self.stages else None for mb in range(m)]
                      for j in range(self.stages)]
        self.w_grad = w.grad

    def forward(self, stage: int, chunk: int, mb: int, x, weight, counter, check: bool = True) -> torch.Tensor:
        """Virtual stage (chunk, stage) on micro-batch mb; x None on the first. ``check``: that
        x, and the gradient its output receives in backward, are the reference's."""
        j = chunk * self.pp + stage
        if j == 0:
            assert x is None
            x = self.data[mb]
        elif check:
            assert torch.equal(x, self.inputs[j][mb]), f"stage {stage} chunk {chunk} mb {mb}: wrong activation"
        act = self.acts[j, mb].clone()
        y = x * weight * act
        counter.activation(act)
        if j == self.stages - 1:
            return (y * self.target[mb]).sum()
        expect = self.grads[j][mb]

        def same(grad):
            assert torch.allclose(grad, expect), f"stage {stage} chunk {chunk} mb {mb}: wrong gradient"

        if check:
            y.register_hook(same)
        counter.boundary(y)
        return y


class Counter:
    """Weak references to what a rank's stage produced, received and sent: the activations its
    chunk-forwards keep for backward (one tensor each) and the [s, b, h] tensors at the stage
    boundary; ``measure`` records the most alive at once, boundary tensors counted by storage
    (a view shares its tensor's memory; a pseudo-freed output, one element, no longer counts)."""

    def __init__(self):
        self.acts, self.edges, self.peak_acts, self.peak_edges = [], [], 0, 0

    def activation(self, t):
        self.acts.append(weakref.ref(t))
        self.measure()

    def boundary(self, t):
        self.edges.append(weakref.ref(t))

    def posting(self, ops: list[tuple[str, int, torch.Tensor]]):
        for _, _, t in ops:
            self.boundary(t)
        self.measure()

    def measure(self):
        self.acts = [r for r in self.acts if r() is not None]
        self.edges = [r for r in self.edges if r() is not None]
        self.peak_acts = max(self.peak_acts, len(self.acts))
        alive = [r() for r in self.edges]
        held = {t.untyped_storage().data_ptr() for t in alive if t is not None and t.numel() == SIZE}
        self.peak_edges = max(self.peak_edges, len(held))


class StubEngine:
    """DeepSpeed's engine as run_pipeline calls it: engine(**micro_batch, hidden, chunk) and
    engine.backward(loss, scale_wrt_gas), the loss divided by the m micro-batches when asked."""

    def __init__(self, chain: Chain, stage: int, counter: Counter):
        self.chain, self.stage, self.counter = chain, stage, counter
        self.w = [torch.nn.Parameter(chain.w[c * chain.pp + stage].clone()) for c in range(chain.vpp)]

    def __call__(self, mb: int, hidden=None, chunk: int = 0):
        return self.chain.forward(self.stage, chunk, mb, hidden, self.w[chunk], self.counter)

    def backward(self, loss, scale_wrt_gas: bool = True):
        self.counter.measure()
        (loss / self.chain.m if scale_wrt_gas else loss).backward()


class FabricP2P(P2P):
    """The runtime's exchanges posted on the fabric instead of torch.distributed."""

    def __init__(self, pipe, fabric: Fabric, counter: Counter):
        super().__init__(pipe)
        self.fabric, self.counter = fabric, counter

    def post(self, ops):
        self.counter.posting(ops)
        self.fabric.post(self.pipe.stage, ops)


def pipe(stage: int, pp: int) -> SimpleNamespace:
    return SimpleNamespace(stage=stage, stages=pp, ranks=list(range(pp)), shape=SHAPE, dtype=torch.float32,
                           device=torch.device("cpu"), group=None)


def run_runtime(chain: Chain) -> tuple[Fabric, list[Counter]]:
    fabric, counters = Fabric(chain.pp), [Counter() for _ in range(chain.pp)]

    def body(s: int) -> None:
        try:
            engine = StubEngine(chain, s, counters[s])
            stage = SimpleNamespace(chunks=[SimpleNamespace(post_process=c * chain.pp + s == chain.stages - 1)
                                            for c in range(chain.vpp)])
            losses = run_pipeline(engine, stage, [{"mb": i} for i in range(chain.m)], pipe(s, chain.pp),
                                  FabricP2P(pipe(s, chain.pp), fabric, counters[s]))
            for c, w in enumerate(engine.w):
                assert torch.allclose(w.grad, chain.w_grad[c * chain.pp + s]), (s, c)
            if s == chain.pp - 1:
                assert torch.allclose(torch.stack(losses), torch.stack(chain.losses))
        finally:
            fabric.finish(s)

    run_ranks(chain.pp, body)
    return fabric, counters


# ------------------------------------------------------------------ megatron-core's schedules
class FakeGroup:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class P2POp:
    """torch.distributed.P2POp as megatron's _batched_p2p_ops builds it, without a group."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0):
        self.op, self.tensor, self.peer = op, tensor, peer


def megatron_communicator(stage: int, pp: int, vpp: int, config):
    """megatron's P2PCommunicator at pp rank ``stage`` (its __init__ asks a process group for
    the neighbours' global ranks: here the pp ranks are the global ones)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    comm = P2PCommunicator.__new__(P2PCommunicator)
    comm.pp_group, comm.config = FakeGroup(stage, pp), config
    comm.next_rank, comm.prev_rank = (stage + 1) % pp, (stage - 1) % pp
    comm.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    return comm


@pytest.fixture(scope="module")
def one_rank_group():
    """megatron's stage tests read the group's rank only once torch.distributed is up
    (utils.get_pg_rank): a one-rank gloo group in this process, its store in memory."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run_megatron(chain: Chain, check: bool = True) -> tuple[Fabric, list[Counter]]:
    """megatron-core's forward_backward_pipelining_with(out)_interleaving on the fabric (needs
    ``one_rank_group``)."""
    import torch.distributed as dist
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import TransformerConfig

    from toolkit.mcore import cpu_compat

    cpu_compat.apply()  # megatron allocates what it receives on torch.cuda.current_device()
    pp, vpp = chain.pp, chain.vpp
    fabric, counters = Fabric(pp), [Counter() for _ in range(pp)]
    local = threading.local()

    def batch_isend_irecv(ops: list[P2POp]) -> list:
        posted = [("send" if op.op is dist.isend else "recv", op.peer, op.tensor) for op in ops]
        local.counter.posting(posted)
        fabric.post(local.stage, posted)
        return [SimpleNamespace(wait=lambda: None) for _ in ops]

    def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, *args,
                     current_microbatch=None, vp_stage=None, **kw):
        x = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        y = chain.forward(local.stage, vp_stage or 0, current_microbatch, x, local.w[vp_stage or 0], local.counter,
                          check)
        if y.dim() == 0:  # the loss: forward_step_calc_loss divides it by the micro-batches
            y = y / num_microbatches
        return ([y] if isinstance(input_tensor, list) else y), torch.tensor(0)

    def body(s: int) -> None:
        try:
            local.stage, local.counter = s, counters[s]
            local.w = [torch.nn.Parameter(chain.w[c * pp + s].clone()) for c in range(vpp)]
            config = TransformerConfig(num_layers=pp * vpp, hidden_size=SHAPE[2], num_attention_heads=1,
                                       pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                       virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                       deallocate_pipeline_outputs=True)
            models = []
            for _ in range(vpp):
                module = torch.nn.Module()
                module.config, module.model_type = config, ModelType.encoder_or_decoder
                models.append(module)
            groups = SimpleNamespace(tp=FakeGroup(0, 1), cp=FakeGroup(0, 1), pp=FakeGroup(s, pp), embd=None,
                                     pos_embd=None, dp_cp=None)
            assert config.batch_p2p_comm and not config.overlap_p2p_comm  # megatron's defaults
            comm = megatron_communicator(s, pp, vpp, config)
            run = (schedules.forward_backward_pipelining_with_interleaving if vpp > 1 else
                   schedules.forward_backward_pipelining_without_interleaving)
            run(forward_step_func=None, data_iterator=[None] * vpp if vpp > 1 else None,
                model=models if vpp > 1 else models[0], num_microbatches=chain.m, seq_length=SHAPE[0],
                micro_batch_size=SHAPE[1], p2p_communicator=comm, pg_collection=groups)
        finally:
            fabric.finish(s)

    zeros = torch.zeros

    def cpu_zeros(*a, **k):  # the schedules count tokens in torch.zeros(..., device="cuda")
        k.pop("device", None)
        return zeros(*a, **k)

    with mock.patch.object(schedules, "forward_step", forward_step), mock.patch("torch.zeros", cpu_zeros), \
            mock.patch.object(dist, "P2POp", P2POp), mock.patch.object(dist, "batch_isend_irecv", batch_isend_irecv):
        run_ranks(pp, body)
    return fabric, counters


def proposed_schedules() -> list[tuple[int, int, int]]:
    """(pp, vpp, micro-batches) the planner proposes at small sizes: interleaved needs a multiple
    of pp (rules.interleaved_microbatches)."""
    return [(pp, vpp, m) for pp in (2, 3, 4) for vpp in (1, 2, 3, 4) for m in range(1, 4 * pp + 1)
            if vpp == 1 or m % pp == 0]


def in_flight_chunks(pp: int, vpp: int, stage: int, m: int) -> float:
    """The planner's chunk-forwards a stage holds at its peak (memory.in_flight x vpp)."""
    from toolkit.estimate.memory import in_flight
    from toolkit.parallel.layout import Layout

    lay = Layout(world=pp, tp=1, pp=pp, vpp=vpp, ep=1, etp=1, cp=1, sequence_parallel=False,
                 gpus_per_node=8)
    return in_flight(lay, stage, m) * vpp


@pytest.mark.parametrize("pp, vpp, m", proposed_schedules())
def test_exchanges_and_memory_are_megatrons(pp, vpp, m, one_rank_group):
    """The runtime runs without a circular wait, every message reaching the receiver that
    consumes it (checked in Chain.forward: the stages' inputs and output gradients, the losses
    and the weights' gradients are the reference's); its batches are megatron's, call by call
    (the same sends and receives, in its order of calls); each stage holds at its peak the
    chunk-forwards the planner counts (megatron's warm-up plus one) and no more boundary
    tensors than megatron's schedule with deallocate_pipeline_outputs (one fewer on some 1F1B
    stages, where megatron's loop variables keep the last input or gradient until reassigned)."""
    chain = Chain(pp, vpp, m)
    ours, held = run_runtime(chain)
    # megatron's own order crosses the two messages of a pair at pp 2 with vpp > 1: run, not checked
    theirs, megatron_held = run_megatron(chain, check=not (pp == 2 and vpp > 1))
    assert ours.batches == theirs.batches
    for s in range(pp):
        assert held[s].peak_acts == megatron_held[s].peak_acts == in_flight_chunks(pp, vpp, s, m), s
        assert held[s].peak_edges <= megatron_held[s].peak_edges, s


def test_megatrons_order_crosses_messages_at_pp2_interleaved(one_rank_group):
    """Negative control of the routing check: megatron's own exchanges at pp = 2, vpp = 2
    (_batched_p2p_ops lists send_prev, recv_prev, send_next, recv_next) send the first stage's
    gradient where the other stage receives an activation (hence the runtime's
    activations-first order, and Megatron-LM's refusal of pp = 2 with this schedule)."""
    with pytest.raises(AssertionError, match="wrong activation"):
        run_megatron(Chain(2, 2, 4))


def tagged_order(s: int, pp: int, vpp: int, m: int) -> list[list[tuple[str, int]]]:
    """What the runtime posted before it followed megatron's calls: a receive right before the
    computation that needs it, each send right after the one that produced it, one message per
    call. At pp = 2 the two ranks share one NCCL stream, on which an unwaited send still runs
    before anything posted after it: each message is its own batch."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    from toolkit.parallel.pipeline import warmup_forwards

    table, last = get_schedule_table(m, vpp, pp), pp * vpp - 1
    prev, nxt = (s - 1) % pp, (s + 1) % pp
    posts = []

    def forward(k):
        j = table[k][1] * pp + s
        posts.extend([[("recv_prev", prev)]] if j > 0 else [])
        posts.extend([[("send_next", nxt)]] if j < last else [])

    def backward(k):
        j = (vpp - 1 - table[k][1]) * pp + s
        posts.extend([[("recv_next", nxt)]] if j < last else [])
        posts.extend([[("send_prev", prev)]] if j > 0 else [])

    warmup, total = warmup_forwards(pp, vpp, s, micro_batches=m), m * vpp
    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return posts


@pytest.mark.parametrize("vpp", [1, 2])
def test_former_posting_order_deadlocks(vpp):
    """Negative control of the deadlock check: the former order of posts (tagged_order) waits
    in a circle at pp = 2, plain 1F1B and interleaved."""
    fabric = Fabric(2)

    def body(s: int) -> None:
        try:
            for batch in tagged_order(s, 2, vpp, 4):
                fabric.post(s, [(role, peer, torch.zeros(SHAPE)) for role, peer in batch])
        finally:
            fabric.finish(s)

    with pytest.raises(Deadlock):
        run_ranks(2, body)
