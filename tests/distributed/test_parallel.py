"""Model parallelism on gloo, 2 and 3 processes: the compressed all-gather / reduce-scatter, the
column-parallel layers against the single-process model (fp32: to float tolerance; 8-bit: within the
codec's error), the hybrid's sub-batches against one batch, and bytes counted against the formulas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lowbit.comm.allreduce import CommStats
from lowbit.comm.gather import all_gather, bytes_all_gather, bytes_reduce_scatter, reduce_scatter
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts
from lowbit.parallel import Hybrid, ParallelComm, parallelize

DETTMERS = ["dettmers:type=dynamic,bucket=0", "dettmers:type=linear,bucket=0", "dettmers:type=static,bucket=0",
            "dettmers:type=mantissa,bucket=0"]
#: relative L2 error of a small Gaussian tensor through the codec (8-bit QSGD ~1%; Dettmers' types up to ~7%
#: with one scale per tensor)
BOUND = {"fp32": 0.0, "qsgd:bits=8,bucket=64": 0.05, **{s: 0.1 for s in DETTMERS}}


@pytest.fixture(scope="module")
def ranks2() -> list:
    parts = (("collectives", _collectives, ()), ("model_parallel", _model_parallel, ()), ("paired", _paired, ()),
             ("hybrid", _hybrid, ()), ("paired_hybrid", _paired_hybrid, ()), ("graph", _graph_flag_on_cpu, ()),
             ("iterables", _plans_take_iterables, ()), ("mismatch", _mismatch, ()))
    # (mismatch after iterables on purpose: iterables caches the plan of an fp32 (4, 3) gather, and the
    # mismatch's first call is that call on rank 0 and an fp16 one on rank 1. Cached plans used to skip the
    # ranks' check, and gloo aborted the process; every call is checked now)
    return spawn(run_parts, 2, parts, backend="gloo")


@pytest.fixture(scope="module")
def ranks3() -> list:
    parts = (("collectives", _collectives, ()), ("model_parallel", _model_parallel, ()), ("paired", _paired, ()),
             ("hybrid", _hybrid, ()), ("hybrid_bytes", _hybrid_bytes, ()))
    return spawn(run_parts, 3, parts, backend="gloo")


def _collectives(rank: int, world: int) -> dict:
    out: dict = {}
    sizes = [3 + r for r in range(world)]  # unequal parts
    for spec in ["fp32", "qsgd:bits=8,bucket=64", *DETTMERS]:
        x = torch.randn(sizes[rank], 5, generator=torch.Generator().manual_seed(rank))
        st = CommStats()
        g = all_gather(x, spec, dim=0, sizes=sizes, stats=st)
        exact = [torch.randn(s, 5, generator=torch.Generator().manual_seed(r)) for r, s in enumerate(sizes)]
        out[("ag", spec)] = (g, torch.cat(exact), st.bytes_sent, bytes_all_gather(spec, (1, 5), 0, sizes))
        # along the last dimension, async
        y = torch.randn(4, sizes[rank], generator=torch.Generator().manual_seed(10 + rank))
        fut = all_gather(y, spec, dim=-1, sizes=sizes, async_op=True)
        out[("ag-1", spec)] = fut.wait()
        # reduce-scatter: every rank's full tensor, this rank's rows of the sum
        z = torch.randn(sum(sizes), 6, generator=torch.Generator().manual_seed(20 + rank))
        total = z.clone()
        dist.all_reduce(total)
        st = CommStats()
        mine = reduce_scatter(z, spec, dim=0, sizes=sizes, stats=st)
        lo = sum(sizes[:rank])
        out[("rs", spec)] = (mine, total[lo : lo + sizes[rank]], st.bytes_sent,
                             bytes_reduce_scatter(spec, tuple(z.shape), 0, sizes, rank))
    try:
        all_gather(torch.randn(2, 5), "fp32", sizes=[3] * world)
        out["bad"] = None
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gather_and_reduce_scatter(world: int, request) -> None:
    res = part(request.getfixturevalue(f"ranks{world}"), "collectives")
    for key, v in res[0].items():
        if key == "bad":
            continue
        kind, spec = key
        for r in range(world):
            if kind == "ag":
                got, exact, sent, formula = res[r][key]
                assert torch.equal(got, res[0][key][0]), (key, r)  # bit-identical on every rank
                assert sent == formula > 0
                assert float((got - exact).norm() / exact.norm()) <= BOUND[spec], key
            elif kind == "ag-1":
                assert torch.equal(res[r][key], v), (key, r)
            else:
                mine, exact, sent, formula = res[r][key]
                assert sent == formula > 0
                tol = 1e-6 if spec == "fp32" else BOUND[spec]
                assert float((mine - exact).norm() / exact.norm()) <= tol, (key, r)
    assert "sizes says 3" in res[0]["bad"]


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 33), nn.ReLU(), nn.Linear(33, 17), nn.ReLU(), nn.Linear(17, 10))


def _model_parallel(rank: int, world: int) -> dict:
    out = {}
    ref = _mlp(0)
    x = torch.randn(64, 20, generator=torch.Generator().manual_seed(5), requires_grad=True)
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(6))
    loss = nn.functional.cross_entropy(ref(x), y)
    loss.backward()
    ref_out = ref(x).detach()
    cases = [("fp32", "fp32")] + [(s, s) for s in DETTMERS] + [("fp32", DETTMERS[0]), (DETTMERS[0], "fp32")]
    for spec, grad_spec in cases:
        comm = ParallelComm(codec=spec, grad_codec=grad_spec)
        mp = parallelize(_mlp(0), comm)
        xx = x.detach().clone().requires_grad_(True)
        logits = mp(xx)
        nn.functional.cross_entropy(logits, y).backward()
        lin = [m for m in mp if hasattr(m, "weight")]
        ref_lin = [m for m in ref if isinstance(m, nn.Linear)]
        w_err = max(float((m.weight.grad - r.weight.grad[m.lo : m.lo + m.weight.shape[0]]).norm()
                          / r.weight.grad[m.lo : m.lo + m.weight.shape[0]].norm()) for m, r in zip(lin, ref_lin))
        out[(spec, grad_spec)] = (logits.detach(), float((logits.detach() - ref_out).norm() / ref_out.norm()),
                     float((xx.grad - x.grad).norm() / x.grad.norm()), w_err, comm.stats.bytes_sent)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_column_parallel_mlp_equals_the_single_process_model(world: int, request) -> None:
    res = part(request.getfixturevalue(f"ranks{world}"), "model_parallel")
    for key, (logits, out_err, x_err, w_err, sent) in res[0].items():
        for r in range(1, world):
            assert torch.equal(logits, res[r][key][0]), key  # identical activations on every rank
        assert sent > 0
        if key == ("fp32", "fp32"):
            assert out_err < 1e-6 and x_err < 1e-5 and w_err < 1e-5, (out_err, x_err, w_err)
        elif key[0] == "fp32":  # 8-bit activation gradients alone: the codec's error (~1%) per reduction
            assert x_err < 0.05 and w_err < 0.05, (key, x_err, w_err)
        else:
            # 8-bit activations: the outputs within the codec's error over three gathers (measured on 2 and
            # 3 ranks: dynamic 1.3%, linear 0.9%, static 6.9%, mantissa 10.3%); the gradients also move
            # where a rounded activation flips a ReLU downstream (one flipped entry of 8 x 17 moved a
            # gradient by 20%): measured 6-12% (dynamic, linear), 15-28% (static, mantissa). Training
            # with each type is the real check (tests/distributed/test_parallel_training.py).
            assert out_err < 0.15, (key, out_err)
            assert x_err < 0.35 and w_err < 0.35, (key, x_err, w_err)


def _convnet(seed: int) -> tuple[nn.Module, nn.Sequential]:
    torch.manual_seed(seed)
    features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten())
    classifier = nn.Sequential(nn.Linear(144, 32), nn.ReLU(), nn.Linear(32, 10))
    return features, classifier


def _grad_or_value(p: torch.Tensor) -> torch.Tensor:
    return (p.grad if p.grad is not None else p).detach().clone()  # (stepped per sub-batch: the values)


def _hybrid(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(12, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (12,), generator=g)
    xs = [torch.randn(12, 1, 8, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ys = []
    for r in range(world):
        gr = torch.Generator().manual_seed(r)
        torch.randn(12, 1, 8, 8, generator=gr)
        ys.append(torch.randint(0, 10, (12,), generator=gr))
    # the single-process model on the global batch
    f, c = _convnet(0)
    ref_loss = nn.functional.cross_entropy(c(f(torch.cat(xs))), torch.cat(ys))
    ref_loss.backward()
    out: dict = {"ref": ([p.grad for p in f.parameters()], [p.grad for p in c.parameters()], float(ref_loss))}
    for spec, sub, each in [("fp32", 1, False), ("fp32", 3, False), ("dettmers:type=dynamic,bucket=0", 3, False),
                            ("fp32", 3, True)]:
        f, c = _convnet(0)
        comm = ParallelComm(codec=spec)
        h = Hybrid(DDP(f), c, comm, sub_batches=sub, update_each=each)
        opt_c = torch.optim.SGD(h.classifier.parameters(), lr=0.1) if each else None
        loss = h.train_step(x, y, nn.functional.cross_entropy, opt_classifier=opt_c)
        lin = [m for m in h.classifier if hasattr(m, "weight")]
        out[(spec, sub, each)] = ([p.grad.clone() for p in f.parameters()],
                                  [(m.lo, _grad_or_value(m.weight), _grad_or_value(m.bias)) for m in lin],
                                  float(loss), comm.stats.bytes_sent, h(x).shape)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_hybrid_equals_one_batch_on_one_process(world: int, request) -> None:
    res = part(request.getfixturevalue(f"ranks{world}"), "hybrid")
    f_ref, c_ref, loss_ref = res[0]["ref"]
    ref_lin = [(c_ref[0], c_ref[1]), (c_ref[2], c_ref[3])]
    for key in [("fp32", 1, False), ("fp32", 3, False), ("dettmers:type=dynamic,bucket=0", 3, False)]:
        tol = 1e-5 if key[0] == "fp32" else 0.35  # 8-bit: as in the column-parallel test above
        for r in range(world):
            f_g, lins, loss, sent, shape = res[r][key]
            assert shape == (12, 10)
            assert abs(loss - loss_ref) <= tol * abs(loss_ref) + 1e-6, (key, loss, loss_ref)
            for a, b in zip(f_g, f_ref):  # the features' gradients after DDP's average
                assert float((a - b).norm() / b.norm()) <= tol, key
            for (lo, wg, bg), (wr, br) in zip(lins, ref_lin):
                n = wg.shape[0]
                assert float((wg - wr[lo : lo + n]).norm() / wr[lo : lo + n].norm()) <= tol, key
                assert float((bg - br[lo : lo + n]).norm() / br[lo : lo + n].norm()) <= tol, key
    # three sub-batches without per-sub-batch updates: the gradients of one batch
    for a, b in zip(res[0][("fp32", 1, False)][0], res[0][("fp32", 3, False)][0]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    # per-sub-batch updates change the classifier between sub-batches: a different step, still finite
    each = res[0][("fp32", 3, True)]
    assert all(bool(torch.isfinite(g).all()) for g in each[0])
    assert each[0][0].sub(res[0][("fp32", 3, False)][0][0]).abs().max() > 0


def _hybrid_bytes(rank: int, world: int) -> tuple[int, int]:
    f, c = _convnet(1)
    spec = "dettmers:type=dynamic,bucket=0"
    comm = ParallelComm(codec=spec)
    h = Hybrid(DDP(f), c, comm, sub_batches=2)
    x = torch.randn(10, 1, 8, 8)
    y = torch.randint(0, 10, (10,))
    h.train_step(x, y, nn.functional.cross_entropy)
    # the formula: per sub-batch (5 rows each), the activations' all-gather and the gradients'
    # reduce-scatter, then inside the classifier the gathers of each layer's output features and the
    # all-reduce of the second layer's input gradient (allgather algorithm: (K-1) slots of the payload)
    from lowbit.comm.allreduce import bytes_sent_per_rank
    from lowbit.comm.gather import part_sizes
    from lowbit.codecs.base import get_codec

    k = world
    rows = 5 * k
    total = 0
    for _ in range(2):
        total += bytes_all_gather(spec, (5, 144), 0, [5] * k)
        total += bytes_reduce_scatter(spec, (rows, 144), 0, [5] * k, rank)
        total += bytes_all_gather(spec, (rows, 1), -1, part_sizes(32, k))
        total += bytes_all_gather(spec, (rows, 1), -1, part_sizes(10, k))
        total += bytes_sent_per_rank(get_codec(spec), rows * 32, k, "auto", rank, shape=(rows, 32))
    return comm.stats.bytes_sent, total


def test_hybrid_bytes_equal_the_formula(ranks3: list) -> None:
    for sent, formula in part(ranks3, "hybrid_bytes"):
        assert sent == formula > 0


def _mismatch(rank: int, world: int) -> list[str]:
    out = []
    for what, call in [
        ("codec", lambda: all_gather(torch.randn(4, 3), "fp32" if rank == 0 else "fp16")),
        # each rank takes every part to be as large as its own: they disagree on the sizes
        ("part size", lambda: all_gather(torch.randn(4 + rank, 3), "fp32")),
        ("shape", lambda: reduce_scatter(torch.randn(6, 3 + rank), "fp32")),
    ]:
        try:
            call()
            out.append(f"{what}: no error")
        except Exception as exc:  # noqa: BLE001
            out.append(f"{what}: {type(exc).__name__}: {exc}")
    return out


def test_ranks_that_disagree_get_a_clear_error(ranks2: list) -> None:
    for msgs in part(ranks2, "mismatch"):
        for m in msgs:
            assert "CollectiveError" in m and "called" in m, m


def slice_grad_error(split: nn.Sequential, ref_linears: list[nn.Linear]) -> float:
    """The largest relative error of a split model's weight and bias gradients against the matching
    slices of the single-process model's (a row-parallel layer: its columns and the whole bias). Also
    used by tests/gpu/test_parallel_nccl.py."""
    from lowbit.parallel import RowParallelLinear

    errs = []
    for m, r in zip([m for m in split if hasattr(m, "weight")], ref_linears):
        if isinstance(m, RowParallelLinear):
            want, wb = r.weight.grad[:, m.lo : m.lo + m.weight.shape[1]], r.bias.grad
        else:
            want, wb = r.weight.grad[m.lo : m.lo + m.weight.shape[0]], r.bias.grad[m.lo : m.lo + m.bias.shape[0]]
        errs.append(max(float((m.weight.grad - want).norm() / want.norm()),
                        float((m.bias.grad - wb).norm() / wb.norm())))
    return max(errs)


def _paired(rank: int, world: int) -> dict:
    """The MLP split in column/row pairs against the single-process model and the unpaired split."""
    from lowbit.parallel import RowParallelLinear

    ref = _mlp(0)
    x = torch.randn(64, 20, generator=torch.Generator().manual_seed(5), requires_grad=True)
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(6))
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_out = ref(x).detach()
    ref_lin = [m for m in ref if isinstance(m, nn.Linear)]
    out = {}
    for spec in ("fp32", DETTMERS[0]):
        for pair in (False, True):
            comm = ParallelComm(codec=spec)
            mp = parallelize(_mlp(0), comm, pair=pair)
            xx = x.detach().clone().requires_grad_(True)
            logits = mp(xx)
            nn.functional.cross_entropy(logits, y).backward()
            out[(spec, pair)] = (logits.detach(), float((logits.detach() - ref_out).norm() / ref_out.norm()),
                                 float((xx.grad - x.grad).norm() / x.grad.norm()), slice_grad_error(mp, ref_lin),
                                 comm.stats.bytes_sent,
                                 sum(isinstance(m, RowParallelLinear) for m in mp))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_column_row_pairs_equal_the_single_process_model_with_fewer_bytes(world: int, request) -> None:
    res = part(request.getfixturevalue(f"ranks{world}"), "paired")
    for key, (logits, out_err, x_err, w_err, sent, rows) in res[0].items():
        for r in range(1, world):
            assert torch.equal(logits, res[r][key][0]), key  # identical outputs on every rank
        assert rows == (1 if key[1] else 0), key
        if key[0] == "fp32":
            assert out_err < 1e-6 and x_err < 1e-5 and w_err < 1e-5, (key, out_err, x_err, w_err)
        else:  # 8-bit: within the codec's error, as the unpaired split (test above)
            assert out_err < 0.15 and x_err < 0.35 and w_err < 0.35, (key, out_err, x_err, w_err)
    for spec in ("fp32", DETTMERS[0]):  # one all-reduce replaces a gather and a reduction
        assert res[0][(spec, True)][4] < res[0][(spec, False)][4], spec


def test_shared_dropout_on_a_slice_draws_the_whole_layer_mask() -> None:
    from lowbit.parallel import SharedDropout

    comm = ParallelComm(codec="fp32")
    whole, sub = SharedDropout(0.5, comm, seed=3), SharedDropout(0.5, comm, seed=3, features=(7, 5, 20))
    x = torch.ones(4, 20)
    assert torch.equal(sub(x[:, 7:12]), whole(x)[:, 7:12])


def _paired_hybrid(rank: int, world: int) -> dict:
    f, c = _convnet(0)
    ref_f, ref_c = _convnet(0)
    xs = [torch.randn(12, 1, 8, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ys = [torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    ref_loss = nn.functional.cross_entropy(ref_c(ref_f(torch.cat(xs))), torch.cat(ys))
    comm = ParallelComm(codec="fp32")
    h = Hybrid(DDP(f), c, comm, sub_batches=2, pair=True)
    loss = h.train_step(xs[rank], ys[rank], nn.functional.cross_entropy)
    return {"loss": (float(loss), float(ref_loss.detach())), "layers": [type(m).__name__ for m in h.classifier]}


def test_hybrid_with_pairs_computes_the_global_batch_loss(ranks2: list) -> None:
    for r in part(ranks2, "paired_hybrid"):
        assert r["layers"] == ["ColumnParallelLinear", "RowParallelLinear"]  # (the ReLU inside the first)
        assert abs(r["loss"][0] - r["loss"][1]) <= 1e-5 * abs(r["loss"][1])


def test_graph_option_is_checked_and_ignored_off_cuda() -> None:
    f, c = _convnet(0)
    with pytest.raises(ValueError, match="update_each"):
        Hybrid(f, c, ParallelComm(codec="fp32"), graph=True, update_each=True)
    with pytest.raises(ValueError, match="stochastic"):
        Hybrid(f, c, ParallelComm(codec="qsgd:bits=8,bucket=512"), graph=True)
    Hybrid(f, c, ParallelComm(codec="qsgd:bits=8,bucket=512,rounding=nearest"), graph=True)  # deterministic: fine


def _graph_flag_on_cpu(rank: int, world: int) -> list:
    out = []
    for graph in (False, True):
        torch.manual_seed(0)
        f, c = _convnet(0)
        c = nn.Sequential(*c[:-1], nn.Dropout(0.5), c[-1]) if len(c) > 1 else c
        h = Hybrid(DDP(f), c, ParallelComm(codec=DETTMERS[0]), graph=graph)
        opt = torch.optim.SGD(h.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        losses = [float(h.train_step(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g),
                                     nn.functional.cross_entropy, opt)) for _ in range(3)]
        out.append((losses, [p.detach().clone() for p in h.parameters()]))
    return out


def test_graph_flag_changes_nothing_off_cuda(ranks2: list) -> None:
    for (l0, p0), (l1, p1) in part(ranks2, "graph"):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_shared_dropout_masks_drawn_into_buffers_equal_the_eager_ones() -> None:
    """The graph path of SharedDropout: masks recorded by shape, drawn before a replay into buffers the
    calls read, are those the eager calls of the same step draw."""
    from lowbit.parallel import SharedDropout

    comm = ParallelComm(codec="fp32")
    for features in (None, (3, 5, 12)):
        d = SharedDropout(0.5, comm, seed=7, features=features)
        xs = [torch.randn(4, 5), torch.randn(6, 5)]
        calls: list = []
        d._record = calls
        comm.step = 11
        eager = [d(x) for x in xs]
        d._record = None
        assert [s for s, _ in calls] == [(4, 5), (6, 5)]
        bufs = [torch.empty(s, dtype=torch.bool) for s, _ in calls]
        d._fill(bufs)
        d._static, d._gcall = bufs, 0
        assert all(torch.equal(d(x), e) for x, e in zip(xs, eager))
        d._static = None
        comm.step = 12
        d._fill(bufs)  # the next step's masks differ
        assert not all(torch.equal(b, (e != 0)) for b, e in zip(bufs, eager))


def test_deferred_runs_its_callback_once_when_waited() -> None:
    from lowbit.comm import collectives as C

    ran = []
    work = C.done(None, torch.device("cpu"))
    d = C.Deferred(work, lambda: ran.append(1) or 5, "all_gather_into_tensor", None)
    assert not d.done() and ran == []
    chained = d.then(lambda f: f.value() + 1)
    assert chained.wait() == 6 and d.wait() == 5 and d.value() == 5 and ran == [1] and d.done()


def _plans_take_iterables(rank: int, world: int) -> list[tuple[int, ...]]:
    x = torch.randn(4, 3)
    # sizes read once, also on the call that finds the cached plan
    return [tuple(all_gather(x, "fp32", dim=0, sizes=iter([4] * world)).shape) for _ in range(2)]


def test_gather_plans_take_iterables(ranks2: list) -> None:
    for r in part(ranks2, "iterables"):
        assert r == [(8, 3), (8, 3)]


def test_a_gather_plan_never_outlives_its_group(tmp_path) -> None:
    """After destroy_process_group, the old group is refused as before the plans existed."""
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    old = dist.group.WORLD
    x = torch.randn(4, 3)
    try:
        all_gather(x, "fp32", group=old)  # a plan made on the live group
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="not initialised"):
        all_gather(x, "fp32", group=old)
