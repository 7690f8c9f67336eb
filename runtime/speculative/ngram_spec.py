"""N-gram speculative decoding in the scheduler: propose before planning, verify after the forward.

    spec = NgramSpeculator(server_args, output_processor, kv)
    spec.propose(running, context_len)      # sets req.draft_ids on the decodes worth speculating
    batch = planner.plan(...)               # a decode with K proposals is an extend of 1 + K tokens
    ... forward: logits at every one of those 1 + K positions ...
    kv.commit(...)                          # as a plain decode: kv_committed_len += 1
    spec.verify(reqs, row_logits)           # accept, append, trim the rejected KV

Verification ("accept while the sampled token equals the proposal"): position j's logits (the
model's view after the last token and proposals 1..j) are sampled with the request's real state,
exactly as a plain decode step would, the token is appended through the usual stop rules, and the
next position is used only when that token equals proposal j + 1. So every output token is drawn
from the same distribution as without speculation (greedy: the same token), penalties, seeds,
min_new_tokens and logprobs see the same state, and a stop inside an accepted run ends there.
The KV of the last token and the accepted proposals is kept; the rejected proposals' KV slots go
back at once (`KVManager.trim_draft`), so the prefix cache never sees a rejected token.

When it speculates (all else decodes plainly, through the one-call CPU decoder where it applies):
a request that is decoding, has room left (max_new_tokens, context) and an n-gram
match, in a batch of at most --speculative-disable-by-batch-size decoding requests, and only as
many proposals as pay for themselves. Each proposal is one more row of the step; whether a row
pays depends on the machine, the model and the batch, so both sides are measured, not assumed:

- `StepCost` learns the wall time of a decode step as a function of its rows from the steps the
  scheduler runs (an average per row count, linear between the counts seen, and beyond the largest
  one a prior of ROW_PRIOR of a step per row that the first steps there replace). At batch 1 on a
  CPU a row costs a few percent of a step (the weights are read once for all rows); at batch 16
  and above the step is bound by compute and a row costs about 1/rows of it.
- Acceptance follows a geometric model: proposal j of a request is accepted with probability p^j,
  p estimated from that request's recent passes (accepted proposals / (accepted + rejections)),
  starting from the server's rate for matches of the same n-gram length.

Per step, the proposals' rows are sorted by expected tokens (p^j) and the number of rows that
maximises expected tokens per second (the decoding requests' own tokens plus the accepted ones,
over StepCost's estimate) is taken, if it beats plain decoding by MIN_GAIN. A request whose
proposals do not pay now is asked again next step, when the batch may have changed.
`--disable-speculative-adaptive` verifies every proposal instead (tests of the verify path).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import torch

from ..layers.sampler import argmax_rows
from ..layers.sampling_batch_info import is_plain_greedy
from .ngram import NgramIndex

ROW_PRIOR = 0.05        # a row's cost beyond the row counts measured, as a fraction of a step
COST_DECAY = 0.8        # weight of the past in StepCost's per-row-count average
ACCEPT_DECAY = 0.8      # weight of the past in a request's acceptance counts (per verify pass)
SERVER_DECAY = 0.99     # the same for the server's counts per match length
PRIOR_WEIGHT = 2.0      # proposals' worth of the server's rate in a request's estimate
MATCH_BUCKETS = 4       # the server's rate is kept for matches of 1, 2, 3 and 4+ tokens
MIN_GAIN = 0.02         # speculate only when the estimate beats plain decoding by this much


class StepCost:
    """Seconds of a decode step by its number of rows (decoding requests + proposals), learned
    from the steps that ran."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.rows: list[int] = []              # the keys of `seconds`, ascending

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        if old is None:
            bisect.insort(self.rows, rows)
            self.seconds[rows] = seconds
        else:
            self.seconds[rows] = COST_DECAY * old + (1 - COST_DECAY) * seconds

    def curve(self, lo: int, hi: int) -> list[float]:
        """Estimated seconds of steps of lo, lo + 1, ..., hi rows (empty before any step ran)."""
        if not self.rows:
            return []
        known, t, out = self.rows, self.seconds, []
        i = bisect.bisect_left(known, lo)
        for r in range(lo, hi + 1):
            while i < len(known) and known[i] < r:
                i += 1
            if i < len(known) and known[i] == r:
                out.append(t[r])
            elif i == 0:                                   # below every count seen: no cheaper
                out.append(t[known[0]])
            elif i == len(known):                          # beyond: the prior per row
                last = known[-1]
                out.append(t[last] * (1 + ROW_PRIOR * (r - last)))
            else:
                a, b = known[i - 1], known[i]
                out.append(t[a] + (t[b] - t[a]) * (r - a) / (b - a))
        return out


@dataclass
class SpecState:
    """One request's proposer index and acceptance counts (owned by the speculator)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    accepted: float = 0.0            # proposals accepted, decayed per verify pass
    rejected: float = 0.0            # passes that ended on a rejected proposal, decayed likewise
    bucket: int = 0                  # the current match's length bucket (server_counts' index)


@dataclass
class SpecTotals:
    """Cumulative counters of one scheduler (stats, /metrics, the decode log line)."""

    verify_ct: int = 0               # verify passes (one per speculating request per step)
    draft_tokens: int = 0            # proposals verified
    accepted_tokens: int = 0         # proposals accepted (kept in the output)


class NgramSpeculator:
    def __init__(self, args, output, kv):
        self.num_draft = args.speculative_num_draft_tokens
        self.min_n = args.speculative_ngram_min_match_window_size
        self.max_n = args.speculative_ngram_max_match_window_size
        self.max_bs = args.speculative_disable_by_batch_size
        self.adaptive = not args.disable_speculative_adaptive
        self.output = output
        self.kv = kv
        self.totals = SpecTotals()
        self.cost = StepCost()
        self.server_counts = [[0.0, 0.0] for _ in range(MATCH_BUCKETS)]   # [accepted, rejected]

    # ------------------------------------------------------------ propose
    def propose(self, running: list, context_len: int) -> None:
        """Sets `draft_ids` of every running request: proposals for the decodes that speculate now,
        empty for the rest."""
        decoding = [r for r in running if r.kv_committed_len >= r.prompt_len and r.extend_len == 1]
        for req in running:
            req.draft_ids = []
        if len(decoding) > self.max_bs:
            return
        rows = []                                  # (expected tokens of the row, its request, draft)
        for req in decoding:
            if req.to_abort is not None or req.finished:
                continue
            k = min(self.num_draft, req.remaining_new_tokens() - 1, context_len - req.seq_len)
            if k <= 0:
                continue
            st = req.spec_state
            if st is None:
                st = req.spec_state = SpecState()
            draft, n = st.index.propose_with_match(req.all_ids, k, self.min_n, self.max_n)
            if draft:
                st.bucket = min(n, MATCH_BUCKETS) - 1
                p = self._accept_probability(st)
                rows.extend((p ** (j + 1), req, draft) for j in range(len(draft)))
        if not rows:
            return
        if not self.adaptive:
            for _, req, draft in rows:
                req.draft_ids = draft
            return
        rows.sort(key=lambda row: -row[0])
        base = len(decoding)
        cost = self.cost.curve(base, base + len(rows))
        if not cost:
            return                                 # nothing measured yet: one plain step first
        plain = base / cost[0]
        best, take, tokens = plain * (1 + MIN_GAIN), 0, float(base)
        for n, (value, _, _) in enumerate(rows, 1):
            tokens += value
            if tokens / cost[n] > best:
                best, take = tokens / cost[n], n
        for _, req, draft in rows[:take]:          # a request's rows come in order (p^j falls with j)
            req.draft_ids = draft[:len(req.draft_ids) + 1]

    def decode_rows(self, batch) -> int:
        """Rows of `batch`'s forward if every request in it decodes (StepCost's unit), else 0."""
        if all(req.kv_committed_len >= req.prompt_len for req in batch.reqs):
            return sum(batch.extend_lens)
        return 0

    def _accept_probability(self, st: SpecState) -> float:
        """p of the geometric model: the request's counts, with PRIOR_WEIGHT proposals of the
        server's rate for matches as long as the current one."""
        acc, rej = self.server_counts[st.bucket]
        server = (acc + 1) / (acc + rej + 2)
        return (st.accepted + PRIOR_WEIGHT * server) / (st.accepted + st.rejected + PRIOR_WEIGHT)

    # ------------------------------------------------------------ forward
    def forward(self, batch, runner, req_to_token_pool, output) -> tuple:
        """The forward pass of a step in which some requests verify proposals. Returns (LogitsOutput with
        one next-token row per request and the input-logprob rows, spans, per-request verify logits).

        All decodes: one DECODE pass over 1 + K rows per speculating request, row j a one-token decode
        of position c + j whose attention reads the request's table row up to c + j + 1 (each layer writes
        the K/V of every row before any row attends, so row j sees the proposals before it). That is the
        plain decode path (the one-call CPU decoder, CUDA graphs), batch 1 + K. With a prefill in the
        batch: one EXTEND pass, the proposals' logits as extra rows."""
        from ..model_executor.forward_batch import ForwardMode
        from ..model_executor.model_runner import LogitsOutput

        reqs, lens = batch.reqs, batch.extend_lens
        ids: list[int] = []
        for req, n in zip(reqs, lens):
            c = req.kv_committed_len
            ids.extend(req.token_slice(c, c + n - len(req.draft_ids)))
            ids.extend(req.draft_ids)
        starts = list(itertools.accumulate(lens, initial=0))
        if all(req.kv_committed_len >= req.prompt_len for req in reqs):
            rows, prefix = [], []
            for req, n in zip(reqs, lens):
                rows.extend([req.req_pool_idx] * n)
                prefix.extend(range(req.kv_committed_len, req.kv_committed_len + n))
            fb = runner.make_forward_batch(ForwardMode.DECODE, ids, rows, prefix, [p + 1 for p in prefix],
                                           batch.out_cache_loc, req_to_token_pool)
            flat = runner.forward(fb).next_token_logits                          # [sum(lens), vocab]
            last = torch.tensor([s - 1 for s in starts[1:]], device=flat.device)
            per_req = [flat[s:e] if req.draft_ids else None for req, s, e in zip(reqs, starts, starts[1:])]
            return LogitsOutput(flat[last], None), [], per_req
        fb = runner.make_forward_batch(ForwardMode.EXTEND, ids, [req.req_pool_idx for req in reqs],
                                       batch.prefix_lens, batch.seq_lens, batch.out_cache_loc, req_to_token_pool)
        lp_rows, spans = output.logprob_rows(batch)
        verify_rows = [r for req, s, n in zip(reqs, starts, lens) for r in range(s + n - 1 - len(req.draft_ids),
                                                                                 s + n - 1)]
        logits = runner.forward(fb, lp_rows + verify_rows)
        extra, per_req, row = logits.extra_logits, [], len(lp_rows)
        for i, req in enumerate(reqs):
            k = len(req.draft_ids)
            per_req.append(torch.cat([extra[row:row + k], logits.next_token_logits[i:i + 1]]) if k else None)
            row += k
        return LogitsOutput(logits.next_token_logits, extra[:len(lp_rows)] if lp_rows else None), spans, per_req

    # ------------------------------------------------------------- verify
    def verify(self, reqs: list, logits: list[torch.Tensor]) -> int:
        """Accepts proposals of `reqs` (each just had its verify pass; its kv_committed_len covers the
        last token) given `logits[i]` [1 + K_i, vocab] at its last token and its proposals. Appends the
        accepted tokens and the model's own next token, frees the rejected proposals' KV. Returns the
        number of tokens appended."""
        drafts = [req.draft_ids for req in reqs]
        if self._plain_greedy(reqs):
            appended = self._verify_greedy(reqs, drafts, logits)
        else:
            appended = self._verify_sampled(reqs, drafts, logits)
        total = 0
        for req, draft, n in zip(reqs, drafts, appended):
            accepted = n - 1                # proposals whose KV is kept (the last appended token has none)
            self.kv.trim_draft(req, accepted, len(draft))
            self._record(req, accepted, len(draft))
            req.draft_ids = []
            total += n
        return total

    def _plain_greedy(self, reqs: list) -> bool:
        return not any(r.return_logprob or r.grammar is not None for r in reqs) and is_plain_greedy(
            [r.sampling_params for r in reqs], [r.output_ids for r in reqs])

    def _verify_greedy(self, reqs: list, drafts: list[list[int]], logits: list[torch.Tensor]) -> list[int]:
        """The argmax of every position at once; then accept in order (stop rules per token)."""
        sizes = [len(x) for x in logits]
        vocab = self.output.vocab_size
        targets = argmax_rows(torch.cat(logits)[:, :vocab]).tolist()
        out, start = [], 0
        for req, draft, size in zip(reqs, drafts, sizes):
            n = 0
            for j in range(size):
                tid = targets[start + j]
                self.output.append_token(req, tid)
                n += 1
                if req.finished or j >= len(draft) or tid != draft[j]:
                    break
            out.append(n)
            start += size
        return out

    def _verify_sampled(self, reqs: list, drafts: list[list[int]], logits: list[torch.Tensor]) -> list[int]:
        """Position by position, the still-accepting requests sampled together with their real state
        (a grammar's mask is the matcher's state after the tokens accepted so far, and the matcher
        advances only over accepted tokens; a jump-forward after one ends the request's run there)."""
        appended = [0] * len(reqs)
        active = list(range(len(reqs)))
        j = 0
        while active:
            rows = torch.stack([logits[i][j] for i in active])
            batch = [reqs[i] for i in active]
            still = []
            for i, req, tid in zip(active, batch, self.output.sample(batch, rows)):
                before = len(req.output_ids)
                self.output.append_token(req, tid)
                appended[i] += 1
                jumped = len(req.output_ids) > before + 1    # grammar jump-forward: the proposals no longer follow
                if not (req.finished or jumped or j >= len(drafts[i]) or tid != drafts[i][j]):
                    still.append(i)
            active, j = still, j + 1
        return appended

    def _record(self, req, accepted: int, drafted: int) -> None:
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted
        t = self.totals
        t.verify_ct += 1
        t.draft_tokens += drafted
        t.accepted_tokens += accepted
        # a pass that ended on a proposal the model did not sample (not on a stop or a jump-forward)
        rejected = 1.0 if accepted < drafted and not req.finished and req.extend_len == 1 else 0.0
        st = req.spec_state
        st.accepted = ACCEPT_DECAY * st.accepted + accepted
        st.rejected = ACCEPT_DECAY * st.rejected + rejected
        server = self.server_counts[st.bucket]
        server[0] = SERVER_DECAY * server[0] + accepted
        server[1] = SERVER_DECAY * server[1] + rejected

    def accept_length(self) -> float:
        """Mean tokens per verify pass (accepted proposals + the model's own token), since start."""
        t = self.totals
        return (t.accepted_tokens + t.verify_ct) / t.verify_ct if t.verify_ct else 0.0
