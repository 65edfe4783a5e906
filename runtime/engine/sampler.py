"""Sampler: next tokens from the logits of one step, per-request parameters and RNG streams.

Every row of a step is handled at once on the logits' device; the host only plans the step
(which rows are greedy, which need a ranking, one random number per sampled row) and reads the
results back:

1. The host puts the rows in three groups: greedy rows (argmax), ranked rows (top_p < 1 or a
   top-k) and plain rows (temperature only). Per-row temperature / top_k / top_p, one uniform
   per sampled row and the row ids of each group travel to the device in ONE host-to-device
   copy (a float64 buffer, pinned and non-blocking on CUDA).
2. Ranking is canonical: tokens by tempered logit, descending, ties by lower token id. top-k
   keeps the first k tokens of that ranking (exactly k: of the tokens tied with the k-th logit,
   the lower ids); top-p then drops a token when the probability mass strictly before it
   (renormalized over the top-k set) already reaches top_p, so at least one token stays.
   Ranked rows rank only a window of K = the group's largest top-k tokens (`torch.topk` over
   unique int64 rank keys: the float's order-preserving bits, then the reversed token id; on
   the CPU, where building the keys costs ~10x the top-k, a float top-k with ties fixed up,
   see `_ranked_by_value`), so with top-k set no row is sorted; a group holding a row with top-p but no top-k pays one
   stable sort of its rows instead. Plain rows keep vocabulary order: no ranking at all.
3. Draws: inverse-transform sampling. Each sampled row takes u ~ U[0, 1) from its own
   torch.Generator (one float64 per row per step) and picks the first position whose float64
   cumulative sum of its truncated probabilities exceeds u x total. Logprobs (raw model
   distribution: log_softmax of the untempered, untruncated logits, as vLLM reports them) and
   their top-n are computed on the device too.
4. Token ids, chosen logprobs, the top-n values/ids and a per-row "logits are finite" flag are
   packed into one float64 tensor and copied to the host ONCE (token ids < 2^53 and fp32 values
   are exact in float64). A row that is not finite still yields some token (nothing here raises
   on NaN); the engine fails that request instead of using it.

Why one uniform per row and not the exponential race (argmax(p / q), q ~ Exp(1)^V): the
request's generator is a CPU torch.Generator (runtime/engine/llm_engine.py), and a seeded request must give
the same tokens whatever else is batched, so every random number of a row must come from that
row's own stream. The race needs V numbers per row: S x V CPU draws plus an S x V host-to-device
copy per step (or one device generator and one launch per row). Inverse-transform sampling needs
one number per row, drawn on the CPU in microseconds and shipped with the parameters; the
sampling itself (softmax, cumsum, searchsorted) stays vectorized on the device. It samples the
same distribution (FlashInfer's sampling kernels use it too): u has 53 random bits and the CDF
is accumulated in float64, so the draw moves no token's probability by more than ~1e-11 even
at V = 128k (a float32 CDF would be off by up to ~1e-7 per token, a bias on flat tails).

Batch independence: a row's draw depends only on its own logits, parameters and generator.
Rank keys are unique, so the first k positions of a window are the same whatever its size K
(which the other rows set), and a full stable sort gives the same order as the keys. The
tokens differ from the per-row `torch.multinomial` sampler this replaced (another algorithm
draws from the same stream); the distribution does not, except at ties: top-k now keeps exactly
k tokens where it kept every token tied with the k-th logit (exact k is what lets a K-token
window stand in for the sort), and top-p's cut among tied tokens follows token ids where it
followed an unstable sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimserve.runtime.engine.sequence import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]  # one per row
    logprobs: list[tuple[float, dict[int, float]] | None]  # per row, when the request asked
    finite: list[bool]  # per row: its logits had a finite maximum (no NaN / +inf, not all -inf)


@dataclass
class _Plan:
    """The host's half of one step: the row groups and the buffer the device gets."""

    n_rows: int
    greedy: list[int]  # rows that take the argmax
    ranked: list[int]  # rows with top-p < 1 or a top-k: ranked, then truncated
    plain: list[int]  # rows sampled from softmax(logits / T) in vocabulary order
    window: int  # tokens ranked per ranked row: their largest top-k (V if one has none)
    want: list[int]  # rows that asked for logprobs
    top_n: int  # the most top logprobs any of them asked for
    host: torch.Tensor  # float64: temperature, u (ranked, plain), top_k, top_p (ranked), rows


def _top_k(p: SamplingParams, vocab: int) -> int:
    """The row's top-k, `vocab` when off (top_k <= 0 or >= vocab)."""
    return p.top_k if 0 < p.top_k < vocab else vocab


def _uniform(gen: torch.Generator | None) -> float:
    """One u ~ U[0, 1) (53 random bits) from the row's stream; the default generator if None.
    A generator on an accelerator works too, at the cost of one synchronization per row."""
    device = gen.device if gen is not None else "cpu"
    return torch.rand((), dtype=torch.float64, generator=gen, device=device).item()


def _plan(
    params: list[SamplingParams], generators: list[torch.Generator | None] | None, vocab: int
) -> _Plan:
    """generators None: no draws (u = 0), for `sampling_probs`."""
    greedy, ranked, plain = [], [], []
    for i, p in enumerate(params):
        if p.greedy:
            greedy.append(i)
        elif p.top_p < 1.0 or _top_k(p, vocab) < vocab:
            ranked.append(i)
        else:
            plain.append(i)
    sampled = ranked + plain
    temps = [params[i].temperature for i in sampled]
    us = (
        [_uniform(generators[i]) for i in sampled]
        if generators is not None
        else [0.0] * len(sampled)
    )
    ks = [_top_k(params[i], vocab) for i in ranked]
    # top_p 1 is off: +inf, so fp32 rounding of the running mass cannot drop a tail token
    ps = [params[i].top_p if params[i].top_p < 1.0 else float("inf") for i in ranked]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    top_n = min(max((params[i].logprobs for i in want), default=0), vocab)
    host = torch.tensor(temps + us + ks + ps + ranked + plain + want, dtype=torch.float64)
    return _Plan(len(params), greedy, ranked, plain, max(ks, default=0), want, top_n, host)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The plan's buffer on `device`: one copy, from pinned memory and non-blocking on CUDA."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass
class _Device:
    """The plan's buffer on the device, sliced into its fields."""

    temp: torch.Tensor  # fp32 [ranked + plain]
    u: torch.Tensor  # float64 [ranked + plain]
    top_k: torch.Tensor  # int64 [ranked]
    top_p: torch.Tensor  # fp32 [ranked]
    ranked: torch.Tensor  # int64 row ids
    plain: torch.Tensor
    want: torch.Tensor

    @classmethod
    def split(cls, buf: torch.Tensor, plan: _Plan) -> _Device:
        r, n = len(plan.ranked), len(plan.ranked) + len(plan.plain)
        temp, u, k, p, ranked, plain, want = buf.split(
            [n, n, r, r, r, len(plan.plain), len(plan.want)]
        )
        return cls(temp.float(), u, k.long(), p.float(), ranked.long(), plain.long(), want.long())


def _select(logits: torch.Tensor, rows: list[int], rows_dev: torch.Tensor) -> torch.Tensor:
    """logits[rows] (no copy when rows are all the rows, in order)."""
    if len(rows) == logits.shape[0]:  # every row, and each group lists its rows in order
        return logits
    return logits.index_select(0, rows_dev)


def rank_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 [n, V] keys that order fp32 x [n, V] canonically: larger value first, equal values
    by lower token id. They are unique per row, so `topk(k)` of them is the first k of the full
    ranking for any k, which is also the order of a stable descending sort."""
    magnitude = x.abs().view(torch.int32)  # IEEE bits of |x| grow with |x|
    ordered = torch.where(x < 0, -magnitude, magnitude)  # -0.0 and +0.0 both map to 0
    rev_id = torch.arange(x.shape[-1] - 1, -1, -1, device=x.device)
    return torch.add(rev_id, ordered.long(), alpha=1 << 32)  # |ordered| < 2^31: no overflow


def _ranked(x: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, token ids) [n, window]: the first `window` tokens of each row's ranking."""
    if window >= x.shape[-1]:
        return x.sort(dim=-1, descending=True, stable=True)
    if x.device.type != "cpu":  # the keys are a few memory-bound passes on a GPU, and no sync
        ids = rank_keys(x).topk(window, dim=-1).indices
        return x.gather(1, ids), ids
    return _ranked_by_value(x, window)


def _ranked_by_value(x: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_ranked` for window < V from a float top-k, which is ~10x cheaper than building the
    int64 keys on a CPU. The float top-k gets the window's values right but may break ties
    either way, so: inside the window, ties are reordered by token id (an id sort, then a
    stable value sort, both on [n, window]); across the window's edge (the window-th and the
    next value equal, so which tied token is in is arbitrary), the row is ranked again by its
    keys. Rows of random or trained logits rarely tie there; a row of -inf past its finite
    tokens does."""
    vals, ids = x.topk(window + 1, dim=-1)
    edge_tied = vals[:, window - 1] == vals[:, window]
    vals, ids = vals[:, :window], ids[:, :window]
    by_id = ids.argsort(dim=-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    by_value = vals.sort(dim=-1, descending=True, stable=True).indices
    vals, ids = vals.gather(1, by_value), ids.gather(1, by_value)
    if edge_tied.any():  # a host read, free on the CPU
        rows = edge_tied.nonzero().squeeze(1)
        exact = rank_keys(x.index_select(0, rows)).topk(window, dim=-1).indices
        ids.index_copy_(0, rows, exact)
        vals.index_copy_(0, rows, x.index_select(0, rows).gather(1, exact))
    return vals, ids


def _truncated_probs(
    ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Unnormalized fp32 probabilities [n, K] over each row's ranked logits after top-k (int64
    [n]: keep the first k positions) and top-p (fp32 [n], inf = off); dropped positions are
    exactly 0."""
    pos = torch.arange(ranked.shape[-1], device=ranked.device)
    probs = ranked.masked_fill(pos >= top_k.unsqueeze(1), float("-inf")).softmax(-1)
    # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
    before = probs.cumsum(-1) - probs
    return probs.masked_fill_(before >= top_p.unsqueeze(1), 0.0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 [n]: per row, the first position whose float64 cumulative probability exceeds
    u x total (u float64 [n] in [0, 1)); a zero-probability position is never returned."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    # strictly below the total, so a later position with cdf == total cannot be reached
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    # guard against a one-ulp non-monotone step of a parallel scan landing on a dropped token:
    # fall back to the row's most likely position -- probability ~1e-16
    ok = probs.gather(1, idx) > 0
    return torch.where(ok, idx, probs.argmax(-1, keepdim=True)).squeeze(1)


def _tempered(
    logits: torch.Tensor, rows: list[int], rows_dev: torch.Tensor, temp: torch.Tensor
) -> torch.Tensor:
    x = _select(logits, rows, rows_dev)
    return x.div_(temp.unsqueeze(1)) if x is not logits else x / temp.unsqueeze(1)


def _ranked_group(logits: torch.Tensor, plan: _Plan, dev: _Device):
    """(token ids [r, K], truncated probabilities [r, K]) of the ranked rows."""
    r = len(plan.ranked)
    ranked, ids = _ranked(_tempered(logits, plan.ranked, dev.ranked, dev.temp[:r]), plan.window)
    return ids, _truncated_probs(ranked, dev.top_k, dev.top_p)


def _plain_group(logits: torch.Tensor, plan: _Plan, dev: _Device) -> torch.Tensor:
    """fp32 probabilities [p, V] of the plain rows, in vocabulary order."""
    r = len(plan.ranked)
    return _tempered(logits, plan.plain, dev.plain, dev.temp[r:]).softmax(-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> SampleResult:
    """logits fp32 [S, V] (one row per sampled sequence) -> tokens and optional logprobs.

    Row i draws with generators[i] (one float64 per step; the default generator when None).
    """
    logits = logits.float()  # no copy for the fp32 logits the model returns
    s, vocab = logits.shape
    if s == 0:
        return SampleResult([], [], [])
    plan = _plan(params, generators, vocab)
    dev = _Device.split(_upload(plan.host, logits.device), plan)
    if plan.greedy:  # one pass over every row beats gathering the greedy ones first
        tokens = logits.argmax(-1)
    else:
        tokens = torch.empty(s, dtype=torch.long, device=logits.device)
    r = len(plan.ranked)
    if plan.ranked:
        ids, probs = _ranked_group(logits, plan, dev)
        picked = ids.gather(1, _inverse_cdf(probs, dev.u[:r]).unsqueeze(1)).squeeze(1)
        tokens.index_copy_(0, dev.ranked, picked)
    if plan.plain:
        tokens.index_copy_(0, dev.plain, _inverse_cdf(_plain_group(logits, plan, dev), dev.u[r:]))
    parts = [tokens.double()]
    if plan.want:
        lp = torch.log_softmax(_select(logits, plan.want, dev.want), -1)
        mine = tokens if len(plan.want) == s else tokens.index_select(0, dev.want)
        parts.append(lp.gather(1, mine.unsqueeze(1)).squeeze(1).double())
        if plan.top_n:
            top = lp.topk(plan.top_n, dim=-1)
            parts += [top.values.flatten().double(), top.indices.flatten().double()]
    parts.append(torch.isfinite(logits.amax(-1)).double())
    values = torch.cat(parts).cpu().tolist()  # the step's one device-to-host copy
    return _unpack(values, params, plan)


def _unpack(values: list[float], params: list[SamplingParams], plan: _Plan) -> SampleResult:
    s, w, n = plan.n_rows, len(plan.want), plan.top_n
    token_ids = [int(v) for v in values[:s]]
    logprobs: list[tuple[float, dict[int, float]] | None] = [None] * s
    top_vals, top_ids = s + w, s + w + w * n
    for r, i in enumerate(plan.want):
        tops = {
            int(values[top_ids + r * n + c]): values[top_vals + r * n + c]
            for c in range(min(params[i].logprobs, n))
        }
        logprobs[i] = (values[s + r], tops)
    return SampleResult(token_ids, logprobs, [v != 0.0 for v in values[-s:]])


def token_logprobs(
    logits: torch.Tensor, targets: list[int], top_n: int
) -> list[tuple[float, dict[int, float]]]:
    """Per row of `logits` [R, V]: (logprob of targets[r], {token id: logprob} of the top_n),
    from the raw model distribution (log_softmax of the untempered logits, as `sample` reports
    logprobs); the prompt logprobs of runtime/engine/llm_engine.py. One device-to-host copy."""
    lp = torch.log_softmax(logits.float(), -1)
    ids = torch.tensor(targets, dtype=torch.long, device=lp.device)
    parts = [lp.gather(1, ids.unsqueeze(1)).squeeze(1).double()]
    n = min(top_n, lp.shape[1])
    if n:
        top = lp.topk(n, dim=-1)
        parts += [top.values.double(), top.indices.double()]
    r = lp.shape[0]
    values = torch.cat([t.flatten() for t in parts]).cpu().tolist()
    out = []
    for i in range(r):
        vals = values[r + i * n : r + (i + 1) * n]
        ids_i = values[r + r * n + i * n : r + r * n + (i + 1) * n]
        out.append((values[i], {int(t): v for t, v in zip(ids_i, vals)}))
    return out


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 [S, V]: the distribution each row of `sample` draws from, in vocabulary order
    (greedy rows: one-hot on the argmax). For tests and benchmarks; `sample` never builds it."""
    logits = logits.float()
    plan = _plan(params, None, logits.shape[1])
    dev = _Device.split(_upload(plan.host, logits.device), plan)
    out = torch.zeros_like(logits)
    if plan.greedy:
        rows = torch.tensor(plan.greedy, device=logits.device)
        out[rows] = out[rows].scatter(1, logits[rows].argmax(-1, keepdim=True), 1.0)
    if plan.ranked:
        ids, probs = _ranked_group(logits, plan, dev)
        out[dev.ranked] = out[dev.ranked].scatter(1, ids, probs / probs.sum(-1, keepdim=True))
    if plan.plain:
        out[dev.plain] = _plain_group(logits, plan, dev)
    return out
