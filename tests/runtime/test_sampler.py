"""The batched sampler against a plain per-row reference: greedy, truncation masks, logprobs,
seeded batch independence, and the sampled distribution itself (chi-square).

The reference is the per-row algorithm the batched sampler replaced, written for clarity with
the canonical ranking (logit descending, ties by lower token id, i.e. a stable sort): temperature,
then top-k keeps the first k ranked tokens, then top-p drops a token when the mass before it
reaches top_p.
`gpu` cases run the same checks on CUDA logits and count the step's synchronizations.
"""

import dataclasses
import math
import warnings

import pytest
import torch

from slimserve.runtime.engine.sampler import (
    SampleResult,
    _ranked_by_value,
    rank_keys,
    sample,
    sampling_probs,
)
from slimserve.runtime.engine.sequence import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """fp32 [V]: the distribution one row should be sampled from."""
    if p.greedy:
        return torch.nn.functional.one_hot(row.argmax(), row.shape[0]).float()
    logits = row / p.temperature
    if 0 < p.top_k < logits.shape[0]:
        order = torch.sort(logits, descending=True, stable=True).indices
        logits = logits.scatter(0, order[p.top_k :], float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits.softmax(-1)


def gens(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


# one of each kind of row: greedy, nucleus with and without top-k, top-k only, plain temperature
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    SamplingParams(temperature=1.2, top_p=0.6),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=7, top_p=0.999),
]


def chi2_critical(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal z (4.75:
    one-sided p ~ 1e-6, so a correct sampler fails this only by a freak seed)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` over the tokens with probs > 0, and df."""
    keep = probs > 0
    expected = probs[keep].double() * counts.sum()
    return float(((counts[keep].double() - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def test_empty_batch():
    assert sample(torch.empty(0, 32), [], []) == SampleResult([], [], [])


@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_finite_logits_are_flagged_and_leave_the_others_alone(device):
    torch.manual_seed(3)
    logits = torch.randn(6, 64) * 2
    params = [MIXED[i % len(MIXED)] for i in range(6)]
    clean = sample(logits.to(device), params, gens(range(6)))
    bad = logits.clone()
    bad[1] = float("nan")
    bad[2, 5] = float("inf")
    bad[4] = float("-inf")
    out = sample(bad.to(device), params, gens(range(6)))  # never raises on them
    assert out.finite == [True, False, False, True, False, True] and all(clean.finite)
    for i in (0, 3, 5):  # the seeded draws of the other rows do not move
        assert out.token_ids[i] == clean.token_ids[i]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_first_argmax(device):
    torch.manual_seed(0)
    logits = (torch.randn(8, 300) * 2).round()  # coarse values: ties at the maximum are common
    logits[3, 10] = logits[3, 200] = logits[3].max() + 1  # an exact tie: the lower id wins
    params = [SamplingParams(temperature=0.0) if i % 2 else MIXED[i % len(MIXED)] for i in range(8)]
    params[3] = SamplingParams(temperature=1e-6)  # below MIN_TEMPERATURE: greedy too
    out = sample(logits.to(device), params, gens(range(8)))
    for i, p in enumerate(params):
        if p.greedy:
            assert out.token_ids[i] == int(logits[i].argmax())
    assert out.token_ids[3] == 10


@pytest.mark.parametrize("device", DEVICES)
def test_truncation_equals_the_per_row_reference(device):
    torch.manual_seed(1)
    vocab = 257
    grid = [
        (t, k, p)
        for t in (0.3, 1.0, 1.7)
        for k in (-1, 1, 2, 40, vocab - 1, vocab, 10 * vocab)
        for p in (1.0, 0.95, 0.5, 0.05)
    ]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in grid]
    logits = torch.randn(len(params), vocab) * 3
    logits[::5, :30] = 4.0  # rows with ties at the top-k boundary: the lower ids stay
    logits[1::7, 100] = float("-inf")  # a masked vocabulary entry never gets mass
    got = sampling_probs(logits.to(device), params).cpu()
    for i, p in enumerate(params):
        want = ref_probs(logits[i], p)
        assert torch.equal(got[i] > 0, want > 0), (i, p.temperature, p.top_k, p.top_p)
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-5)
    # the masks really truncate: top-k 1 keeps one token, top-p 0.05 keeps a few
    sizes = {(p.top_k, p.top_p): int((got[i] > 0).sum()) for i, p in enumerate(params) if i % 5}
    assert sizes[(1, 1.0)] == 1 and 1 <= sizes[(-1, 0.05)] < 10 and sizes[(-1, 1.0)] == vocab


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_boundary_and_ties_are_exact(device):
    # four equal logits: each token has exactly 0.25, so the mass before token j is exactly j/4.
    # A token goes when the mass before it reaches top_p, and ties are broken by token id.
    logits = torch.zeros(3, 4)
    params = [
        SamplingParams(top_p=0.5),
        SamplingParams(top_p=0.25),
        SamplingParams(top_p=0.5000001),
    ]
    got = sampling_probs(logits.to(device), params).cpu()
    assert (got > 0).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert got.sum(-1).tolist() == pytest.approx([1.0, 1.0, 1.0])
    # top-k keeps exactly k tokens; of those tied with the k-th logit, the lower ids
    tied = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    for p in (SamplingParams(top_k=2), SamplingParams(top_k=3, top_p=0.9999)):
        keep = [[1, 0, 1, 0, 0, 0]] if p.top_k == 2 else [[1, 0, 1, 1, 0, 0]]
        assert (sampling_probs(tied.to(device), [p]).cpu() > 0).tolist() == keep
    # -0.0 and +0.0 are one value: ranked by id in both the window and the full-sort paths
    zeros = torch.tensor([[0.0, -0.0, 0.0, -0.0, -5.0]])
    for p in (
        SamplingParams(top_k=2),
        SamplingParams(top_k=2, top_p=0.99),
        SamplingParams(top_p=0.45),
    ):
        assert (sampling_probs(zeros.to(device), [p]).cpu() > 0).tolist() == [[1, 1, 0, 0, 0]]


def test_cpu_float_topk_window_equals_the_exact_key_ranking():
    # the CPU ranks a window with a float top-k and fixes ties up; it must give exactly the
    # canonical first `window` tokens (values and ids) that the int64 keys give, on rows full of
    # ties: bf16-rounded logits, a run of -inf, +-0.0, and a tie straddling the window's edge
    torch.manual_seed(5)
    vocab = 300
    x = (torch.randn(16, vocab) * 2).bfloat16().float()
    x[1, 40:] = float("-inf")
    x[2, :] = 0.0
    x[2, 1::2] = -0.0
    x[3, :20] = 7.0
    x[4] = x[4].round()
    for window in (1, 2, 5, 19, 20, 21, 39, 40, 41, 64, vocab - 1):
        got_vals, got_ids = _ranked_by_value(x, window)
        want_ids = rank_keys(x).topk(window, dim=-1).indices
        assert torch.equal(got_ids, want_ids), window
        assert torch.equal(got_vals, x.gather(1, want_ids)), window


@pytest.mark.parametrize("device", DEVICES)
def test_draws_stay_inside_the_truncated_set(device):
    torch.manual_seed(2)
    logits = torch.randn(len(MIXED) * 50, 64) * 2
    params = MIXED * 50
    allowed = torch.stack([ref_probs(r, p) for r, p in zip(logits, params)]) > 0
    g = gens(range(len(params)))
    for _ in range(20):
        out = sample(logits.to(device), params, g)
        assert all(allowed[i, t] for i, t in enumerate(out.token_ids))


def _seeded_run(p: SamplingParams, seed: int, steps, device, pos: int | None = None) -> list[int]:
    """The tokens one seeded row draws over `steps`, alone (pos None) or at `pos` among MIXED rows
    with their own generators and fresh logits every step."""
    g = torch.Generator().manual_seed(seed)
    others = gens(range(100, 100 + len(MIXED)))
    out = []
    for s in steps:
        if pos is None:
            out.append(sample(s.to(device), [p], [g]).token_ids[0])
            continue
        rows = list((torch.randn(len(MIXED), s.shape[1]) * 2).bfloat16().float())
        rows.insert(pos, s[0])
        batch = sample(
            torch.stack(rows).to(device),
            MIXED[:pos] + [p] + MIXED[pos:],
            others[:pos] + [g] + others[pos:],
        )
        out.append(batch.token_ids[pos])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [MIXED[1], MIXED[3], MIXED[4]], ids=["nucleus", "top_k", "plain"])
def test_seeded_rows_are_reproducible_and_batch_independent(device, p):
    torch.manual_seed(3)
    # bf16-rounded logits (as a bf16 model's lm_head gives): ties among the top tokens are common,
    # and alone the nucleus row ranks a top-50 window while the batch (with a top-p-only row)
    # takes the full-sort path: both must rank, and so draw, the same
    steps = [(torch.randn(1, 500) * 2).bfloat16().float() for _ in range(20)]
    assert all(s[0].topk(50).values.unique().numel() < 50 for s in steps[:5])
    alone = _seeded_run(p, 1234, steps, device)
    assert alone == _seeded_run(p, 1234, steps, device)
    for pos in (0, 4, len(MIXED)):
        assert _seeded_run(p, 1234, steps, device, pos) == alone
    assert _seeded_run(p, 4321, steps, device) != alone  # another seed, another stream


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_the_raw_log_softmax(device):
    torch.manual_seed(4)
    logits = torch.randn(5, 300) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_p=0.5, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=3, logprobs=20),
        SamplingParams(temperature=0.0, logprobs=1),
    ]
    out = sample(logits.to(device), params, gens(range(5)))
    ref = torch.log_softmax(logits, -1)  # before temperature and truncation
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        chosen, tops = out.logprobs[i]
        assert chosen == pytest.approx(float(ref[i, out.token_ids[i]]), abs=1e-5)
        top = torch.topk(ref[i], p.logprobs)
        assert list(tops) == top.indices.tolist()
        assert list(tops.values()) == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.logprobs[1][1] == {}
    # more top logprobs asked for than the vocabulary has: all of it
    small = sample(
        torch.randn(1, 8).to(device), [SamplingParams(temperature=0.0, logprobs=20)], [None]
    )
    assert sorted(small.logprobs[0][1]) == list(range(8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=9, top_p=0.9),  # nucleus row (sorted order)
        SamplingParams(temperature=1.5, top_k=6),  # vocab-order row with top-k
        SamplingParams(temperature=0.7),  # plain temperature
    ],
    ids=["nucleus", "top_k", "plain"],
)
def test_sampled_distribution_matches_the_tempered_truncated_softmax(device, params):
    """20 000 draws of one small-vocab row, each from its own seeded generator in one batch,
    then 2 000 successive draws from a single generator: Pearson chi-square against
    softmax(logits / T) after truncation. Getting the temperature, the top-k threshold or the
    top-p cut off by one token, or a biased draw, puts the statistic far above the critical
    value (and a draw on a dropped token fails outright)."""
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -3.0])
    want = ref_probs(logits, params)
    n = 20_000
    out = sample(logits.expand(n, -1).contiguous().to(device), [params] * n, gens(range(n)))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[0])
    assert counts[want == 0].sum() == 0
    stat, df = chi2(counts, want)
    assert stat < chi2_critical(df), (stat, df, counts.tolist())

    g = torch.Generator().manual_seed(7)
    one_row = logits.unsqueeze(0).to(device)
    stream = [sample(one_row, [params], [g]).token_ids[0] for _ in range(2_000)]
    counts = torch.bincount(torch.tensor(stream), minlength=logits.shape[0])
    assert counts[want == 0].sum() == 0
    stat, df = chi2(counts, want)
    assert stat < chi2_critical(df), (stat, df, counts.tolist())


def test_the_distribution_test_detects_a_wrong_sampler():
    """The chi-square check above rejects the usual mistakes: temperature ignored, top-p keeping
    one token too many (the inclusive cut) and top-k ignored, at the test's sample size."""
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -3.0])
    p = SamplingParams(temperature=0.8, top_k=9, top_p=0.9)
    want = ref_probs(logits, p)
    wrong = [
        ref_probs(logits, SamplingParams(temperature=1.0, top_k=9, top_p=0.9)),
        ref_probs(logits, SamplingParams(temperature=0.8, top_k=9, top_p=0.95)),
        ref_probs(logits, SamplingParams(temperature=0.8, top_p=0.9)),
    ]
    gen = torch.Generator().manual_seed(0)
    for bad in wrong:
        assert not torch.equal(bad > 0, want > 0) or (bad - want).abs().max() > 0.01
        counts = torch.bincount(
            torch.multinomial(bad, 20_000, replacement=True, generator=gen),
            minlength=logits.shape[0],
        )
        fails = counts[want == 0].sum() > 0
        stat, df = chi2(counts, want)
        assert fails or stat > chi2_critical(df)
    counts = torch.bincount(
        torch.multinomial(want, 20_000, replacement=True, generator=gen), minlength=logits.shape[0]
    )
    assert chi2(counts, want)[0] < chi2_critical(chi2(counts, want)[1])


@pytest.mark.gpu
def test_one_synchronizing_copy_per_step_on_cuda():
    """A step of a mixed batch with logprobs synchronizes with the GPU once: the result copy."""
    torch.manual_seed(5)
    params = [dataclasses.replace(p, logprobs=3) if i % 2 else p for i, p in enumerate(MIXED * 4)]
    logits = torch.randn(len(params), 32000, device="cuda")
    g = gens(range(len(params)))
    sample(logits, params, g)  # warm-up: allocations, pinned host buffer
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sample(logits, params, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
