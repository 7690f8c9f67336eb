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
a request that is decoding, has no grammar, has room left (max_new_tokens, context), and an n-gram
match; the batch has at most --speculative-disable-by-batch-size decoding requests; and the
request's recent acceptance pays for a verify pass (an exponential average of accepted proposals
per verify; below MIN_ACCEPT it rests, for a back-off that doubles each time, then tries again).
A request proposes at most about one token more than that average (each proposal is one more row
of the pass), up to --speculative-num-draft-tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..layers.sampler import argmax_rows
from ..layers.sampling_batch_info import is_plain_greedy
from .ngram import NgramIndex

MIN_ACCEPT = 1.0        # accepted proposals per verify (average) below which a request rests
EMA_DECAY = 0.7         # weight of the past in that average
FIRST_REST = 4          # decode steps of the first rest; doubled each time, up to MAX_REST
MAX_REST = 256


@dataclass
class SpecState:
    """One request's proposer index and acceptance history (owned by the speculator)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    ema: float = 1.0                 # a first pass that accepts nothing starts a rest
    rest: int = 0                    # decode steps left without proposing
    next_rest: int = FIRST_REST


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
        self.output = output
        self.kv = kv
        self.totals = SpecTotals()

    # ------------------------------------------------------------ propose
    def propose(self, running: list, context_len: int) -> None:
        """Sets `draft_ids` of every running request: proposals for the decodes that speculate now,
        empty for the rest."""
        decoding = [r for r in running if r.kv_committed_len >= r.prompt_len and r.extend_len == 1]
        for req in running:
            req.draft_ids = []
        if len(decoding) > self.max_bs:
            return
        for req in decoding:
            if req.grammar is not None or req.to_abort is not None or req.finished:
                continue
            st = req.spec_state
            if st is None:
                st = req.spec_state = SpecState()
            if st.rest > 0:
                st.rest -= 1
                continue
            # each proposal costs a row of the pass: propose about one more than recently accepted
            k = min(self.num_draft, int(st.ema) + 2, req.remaining_new_tokens() - 1, context_len - req.seq_len)
            if k <= 0:
                continue
            req.draft_ids = st.index.propose(req.all_ids, k, self.min_n, self.max_n)

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
        return not any(r.return_logprob for r in reqs) and is_plain_greedy(
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
        """Position by position, the still-accepting requests sampled together with their real state."""
        appended = [0] * len(reqs)
        active = list(range(len(reqs)))
        j = 0
        while active:
            rows = torch.stack([logits[i][j] for i in active])
            batch = [reqs[i] for i in active]
            still = []
            for i, req, tid in zip(active, batch, self.output.sample(batch, rows)):
                self.output.append_token(req, tid)
                appended[i] += 1
                if not (req.finished or j >= len(drafts[i]) or tid != drafts[i][j]):
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
        st = req.spec_state
        st.ema = EMA_DECAY * st.ema + (1 - EMA_DECAY) * accepted
        if st.ema < MIN_ACCEPT:
            st.rest, st.next_rest = st.next_rest, min(st.next_rest * 2, MAX_REST)
            st.ema = MIN_ACCEPT      # after the rest, one more verify decides
        elif accepted:
            st.next_rest = FIRST_REST

    def accept_length(self) -> float:
        """Mean tokens per verify pass (accepted proposals + the model's own token), since start."""
        t = self.totals
        return (t.accepted_tokens + t.verify_ct) / t.verify_ct if t.verify_ct else 0.0
