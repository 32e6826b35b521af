"""Offline data sets, synthetic inputs and rank sharding."""

from __future__ import annotations

import random
import socket

import numpy as np
import pytest
import torch

from lowbit.lab.data import (
    ShardedLoader,
    ShardedSampler,
    available_datasets,
    load_dataset,
    shard_indices,
)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_registry():
    assert available_datasets() == ["an4", "cifar10", "digits", "imagenet", "mnist", "mnist1d", "pysource", "synthetic", "text"]
    with pytest.raises(ValueError, match="unknown data set 'imagenet21k'.*cifar10.*digits.*mnist1d"):
        load_dataset("imagenet21k")


def test_digits_offline_shapes_and_split(no_network):
    d = load_dataset("digits", seed=0)
    assert (d.n_train, d.n_test) == (1437, 360)
    assert d.x_train.shape == (1437, 1, 8, 8) and d.x_train.dtype == torch.float32
    assert d.in_shape == (1, 8, 8) and d.num_classes == 10 and not d.synthetic
    assert d.y_train.dtype == torch.int64
    # stratified: every class in both splits
    assert torch.bincount(d.y_train, minlength=10).min() > 100
    assert torch.bincount(d.y_test, minlength=10).min() >= 35
    # standardised on the training split
    assert abs(float(d.x_train.mean())) < 1e-4 and abs(float(d.x_train.std()) - 1) < 1e-3
    # the split is a function of the seed
    again, other = load_dataset("digits", seed=0), load_dataset("digits", seed=1)
    assert torch.equal(again.x_test, d.x_test)
    assert not torch.equal(other.x_test, d.x_test)


def test_mnist1d_small_generates_offline_and_keeps_global_rng(no_network, monkeypatch):
    """Fast equivalent of test_mnist1d_generates_offline_and_keeps_global_rng (slow): the same generation
    path (make_dataset inside lowbit's RNG guard, network blocked) with the package's arguments but 500
    samples instead of 5,000; the cache is cleared after, so the canonical set is generated again."""
    import mnist1d.data

    from lowbit.lab.data import mnist1d as m

    def small_args():
        args = real_args()
        args.num_samples = 500
        return args

    real_args = mnist1d.data.get_dataset_args
    monkeypatch.setattr(mnist1d.data, "get_dataset_args", small_args)
    monkeypatch.setenv(m.CACHE_DIR_ENV, "none")  # generate, whatever an earlier run left on disk
    m._generate.cache_clear()
    try:
        np.random.seed(123)
        random.seed(123)
        np_before, py_before = np.random.get_state()[1].copy(), random.getstate()
        d = load_dataset("mnist1d")
        assert np.array_equal(np.random.get_state()[1], np_before) and random.getstate() == py_before
        assert d.x_train.shape == (400, 1, 40) and d.x_test.shape == (100, 1, 40)
        assert d.in_shape == (1, 40) and d.num_classes == 10 and not d.synthetic
        assert set(d.y_train.tolist()) == set(range(10)) and set(d.y_test.tolist()) == set(range(10))
        assert abs(float(d.x_train.mean())) < 0.1 and 0.8 < float(d.x_train.std()) < 1.2
        assert torch.equal(load_dataset("mnist1d", seed=5).x_train, d.x_train)
    finally:
        m._generate.cache_clear()  # (no other test may see the 500-sample set)


@pytest.mark.slow
def test_mnist1d_generates_offline_and_keeps_global_rng(no_network, monkeypatch):
    """The canonical 5,000 samples. Fast equivalent: test_mnist1d_small_generates_offline_and_keeps_global_rng."""
    from lowbit.lab.data import mnist1d as m

    monkeypatch.setenv(m.CACHE_DIR_ENV, "none")
    m._generate.cache_clear()  # really generate inside this test, with the network blocked
    np.random.seed(123)
    random.seed(123)
    np_before, py_before = np.random.get_state()[1].copy(), random.getstate()
    d = load_dataset("mnist1d")
    assert np.array_equal(np.random.get_state()[1], np_before) and random.getstate() == py_before
    assert d.x_train.shape == (4000, 1, 40) and d.x_test.shape == (1000, 1, 40)
    assert d.in_shape == (1, 40) and d.num_classes == 10 and not d.synthetic
    assert set(d.y_train.tolist()) == set(range(10)) and set(d.y_test.tolist()) == set(range(10))
    assert abs(float(d.x_train.mean())) < 0.1 and 0.8 < float(d.x_train.std()) < 1.2
    # canonical: the same arrays whatever seed we pass
    assert torch.equal(load_dataset("mnist1d", seed=5).x_train, d.x_train)


def _ten_samples_args(real_args):
    """The package's arguments with 10 samples: 8 train / 2 test, the shapes of the stand-in generators."""
    def args():
        a = real_args()
        a.num_samples = 10
        return a
    return args


def _stand_in_mnist1d(monkeypatch, tmp_path, rng):
    """mnist1d's generator replaced by one that counts its calls (``calls``) and makes 8 + 2 samples from
    ``rng(calls)``, the cache in ``tmp_path``; ``load()`` loads the data set as a new process would (the
    in-process cache cleared)."""
    import mnist1d.data

    from lowbit.lab.data import mnist1d as m

    calls = []

    def fake_make_dataset(args):
        calls.append(args.num_samples)
        g = rng(len(calls))
        return {"x": g.standard_normal((8, 40)), "y": np.arange(8) % 10,
                "x_test": g.standard_normal((2, 40)), "y_test": np.arange(2)}

    monkeypatch.setattr(mnist1d.data, "make_dataset", fake_make_dataset)
    monkeypatch.setattr(mnist1d.data, "get_dataset_args", _ten_samples_args(mnist1d.data.get_dataset_args))
    monkeypatch.setenv(m.CACHE_DIR_ENV, str(tmp_path))

    def load():
        m._generate.cache_clear()
        return load_dataset("mnist1d")

    return calls, load


def test_mnist1d_is_cached_on_disk_and_a_damaged_file_is_generated_again(tmp_path, monkeypatch):
    """The on-disk cache (lowbit.lab.data.mnist1d's doc) with a stand-in generator that counts its calls: the
    second process (the in-process cache cleared) reads the file; a truncated file, or arrays that no
    longer match their hash, are generated again and replaced; ``none`` turns the cache off; a cache
    that cannot be written is skipped."""
    from lowbit.lab.data import mnist1d as m

    # each generation differs: a read shows as the first's arrays
    calls, load = _stand_in_mnist1d(monkeypatch, tmp_path, np.random.default_rng)

    try:
        first = load()
        files = list(tmp_path.glob("mnist1d-*.npz"))
        assert len(calls) == 1 and len(files) == 1
        again = load()
        assert len(calls) == 1 and torch.equal(again.x_train, first.x_train) and torch.equal(again.y_test, first.y_test)

        files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
        assert not torch.equal(load().x_train, first.x_train) and len(calls) == 2
        assert len(calls) == 2 and torch.equal(load().x_train, load().x_train)  # rewritten whole: read back

        with np.load(files[0]) as f:  # an array changed behind its hash
            arrays = {k: f[k] for k in f.files}
        arrays["x"] = arrays["x"] + 1
        np.savez(files[0], **arrays)
        load()
        assert len(calls) == 3

        monkeypatch.setenv(m.CACHE_DIR_ENV, "none")
        load(), load()
        assert len(calls) == 5

        blocked = tmp_path / "a-file"
        blocked.write_text("")
        monkeypatch.setenv(m.CACHE_DIR_ENV, str(blocked / "cache"))  # cannot be made: skipped
        assert load().x_train.shape == (8, 1, 40) and len(calls) == 6
    finally:
        m._generate.cache_clear()


def test_mnist1d_cache_of_another_shape_or_labels_is_generated_again(tmp_path, monkeypatch):
    """A whole cache file (its hash matches) that is not the data set the generator's arguments give:
    other sample counts, labels outside 0-9, signals that are not floats or labels that are not ints.
    Each is generated again and replaced, never used (issue 44)."""
    from lowbit.lab.data import mnist1d as m

    calls, load = _stand_in_mnist1d(monkeypatch, tmp_path, lambda _: np.random.default_rng(0))

    try:
        good = load()
        (path,) = tmp_path.glob("mnist1d-*.npz")
        g = np.random.default_rng(1)
        x, x_test = g.standard_normal((8, 40)), g.standard_normal((2, 40))
        y, y_test = np.arange(8) % 10, np.arange(2)
        for bad in ({"x": g.standard_normal((7, 40)), "y": np.arange(7) * 167, "x_test": x_test, "y_test": y_test},
                    {"x": x, "y": y, "x_test": x_test, "y_test": np.array([3, 10])},
                    {"x": x, "y": y - 1, "x_test": x_test, "y_test": y_test},
                    {"x": x[:, :39], "y": y, "x_test": x_test[:, :39], "y_test": y_test},
                    {"x": (x * 100).astype(np.int64), "y": y, "x_test": x_test, "y_test": y_test},
                    {"x": x, "y": y.astype(np.float64), "x_test": x_test, "y_test": y_test}):
            m._write(path, bad)  # self-consistent: its hash matches its arrays
            before = len(calls)
            d = load()
            assert len(calls) == before + 1, {k: (a.dtype, a.shape) for k, a in bad.items()}
            assert torch.equal(d.x_train, good.x_train) and torch.equal(d.y_train, good.y_train)
            assert torch.equal(d.y_test, good.y_test) and d.in_shape == (1, 40)
            load()
            assert len(calls) == before + 1  # replaced by the right arrays, which are read back
    finally:
        m._generate.cache_clear()


@pytest.mark.parametrize("n, world", [(12, 3), (10, 1), (64, 8)])
def test_shards_are_disjoint_and_cover_when_divisible(n, world):
    for drop_last in (False, True):
        shards = [shard_indices(n, r, world, seed=7, epoch=2, drop_last=drop_last) for r in range(world)]
        flat = torch.cat(shards).tolist()
        assert sorted(flat) == list(range(n))  # covering and disjoint
        assert len({len(s) for s in shards}) == 1


def test_shards_uneven_pad_or_drop():
    n, world = 10, 4
    padded = [shard_indices(n, r, world, seed=0) for r in range(world)]
    assert [len(s) for s in padded] == [3, 3, 3, 3]
    assert set(torch.cat(padded).tolist()) == set(range(n))  # covers; 2 samples repeat
    dropped = [shard_indices(n, r, world, seed=0, drop_last=True) for r in range(world)]
    flat = torch.cat(dropped).tolist()
    assert [len(s) for s in dropped] == [2, 2, 2, 2] and len(set(flat)) == 8  # disjoint
    # more ranks than samples still gives every rank a (repeated) sample
    tiny = [shard_indices(2, r, 5) for r in range(5)]
    assert all(len(s) == 1 for s in tiny)


def test_shards_deterministic_by_seed_and_epoch():
    a = shard_indices(100, 1, 4, seed=3, epoch=0)
    assert torch.equal(a, shard_indices(100, 1, 4, seed=3, epoch=0))
    assert not torch.equal(a, shard_indices(100, 1, 4, seed=3, epoch=1))
    assert not torch.equal(a, shard_indices(100, 1, 4, seed=4, epoch=0))
    swapped = shard_indices(100, 1, 4, seed=0, epoch=1), shard_indices(100, 1, 4, seed=1, epoch=0)
    assert not torch.equal(*swapped)
    assert shard_indices(8, 1, 2, shuffle=False).tolist() == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="rank"):
        shard_indices(10, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        shard_indices(10, 0, 0)


def test_sampler_works_with_dataloader_and_set_epoch():
    data = torch.utils.data.TensorDataset(torch.arange(20))
    seen = []
    for rank in range(2):
        sampler = ShardedSampler(20, rank, 2, seed=1)
        sampler.set_epoch(3)
        assert len(sampler) == 10
        loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
        seen += [int(v) for (batch,) in loader for v in batch]
    assert sorted(seen) == list(range(20))


def test_loader_batches_cover_the_data_across_ranks():
    d = load_dataset("digits")
    world, bs = 3, 64
    labels = []
    for rank in range(world):
        loader = d.loader("train", batch_size=bs, rank=rank, world_size=world, seed=0, drop_last=True)
        loader.set_epoch(1)
        batches = list(loader)
        assert len(batches) == len(loader) == (1437 // world) // bs
        assert all(x.shape == (bs, 1, 8, 8) and y.shape == (bs,) for x, y in batches)
        labels += [y for _, y in batches]
    # all ranks together saw distinct samples (drop_last: disjoint shards)
    test = d.loader("test", batch_size=50, rank=0, world_size=1)
    xs = torch.cat([x for x, _ in test])
    assert torch.equal(xs, d.x_test)  # test split: unshuffled, whole
    with pytest.raises(ValueError, match="batch_size"):
        ShardedLoader(d.x_test, d.y_test, batch_size=0)


def test_text_corpus_yields_language_model_batches(no_network):
    d = load_dataset("text", seq_len=32)
    assert d.task == "sequence" and not d.synthetic
    assert d.in_shape == (32,) and d.x_train.dtype == torch.int64
    assert d.num_classes == len(d.meta["vocab"]) >= 60
    assert d.meta["chars"] > 100_000 and len(d.meta["sha256"]) == 64
    assert d.n_train > 2000 and d.n_test > 200
    # targets are the inputs shifted by one character, across window boundaries too
    assert torch.equal(d.x_train[:, 1:], d.y_train[:, :-1])
    assert torch.equal(d.y_train[:-1, -1], d.x_train[1:, 0])
    assert int(d.x_train.max()) < d.num_classes and int(d.x_train.min()) >= 0
    text = "".join(d.meta["vocab"][i] for i in d.x_train[:20].flatten().tolist())
    assert sum(c.isalpha() or c == " " for c in text) > 0.7 * len(text)  # prose, not noise
    x, y = next(iter(d.loader("train", batch_size=16, rank=1, world_size=2)))
    assert x.shape == y.shape == (16, 32)


def test_synthetic_is_flagged_and_shaped_for_models():
    state = torch.get_rng_state()
    d = load_dataset("synthetic", model="resnet50", n_train=2, n_test=1)
    assert torch.equal(torch.get_rng_state(), state)  # private generator
    assert d.synthetic and d.label.startswith("SYNTHETIC")
    assert d.x_train.shape == (2, 3, 224, 224) and d.num_classes == 1000
    again = load_dataset("synthetic", model="resnet50", n_train=2, n_test=1)
    assert torch.equal(d.x_train, again.x_train)
    lstm = load_dataset("synthetic", model="lstm", n_train=4)
    assert lstm.synthetic and lstm.x_train.shape == (4, 16, 363) and lstm.y_train.shape == (4, 16)
    tokens = load_dataset("synthetic", model="lstm", in_shape=(8,), num_classes=50, n_train=4)
    assert tokens.x_train.dtype == torch.int64 and int(tokens.x_train.max()) < 50
    plain = load_dataset("synthetic", in_shape=(1, 40), num_classes=10, n_train=8)
    assert plain.synthetic and plain.x_train.shape == (8, 1, 40)
    assert not any(load_dataset(n).synthetic for n in ("digits", "text"))
