"""Pure tests of the DSL (no server): IR, sampling params, chat templates, tracer and prefix finding,
the prefix-cache lint, select's token-span alignment, SSE/error parsing and Runtime's CLI mapping."""

from __future__ import annotations

import json
import random
import re
import warnings

import httpx
import jinja2
import pytest

import radixlm.api as sgl
from radixlm.frontend_lang.backend.openai import match_choice
from radixlm.frontend_lang.backend.runtime import server_cli_args
from radixlm.frontend_lang.backend.runtime_endpoint import choice_spans, error_from_response, iter_sse
from radixlm.frontend_lang.chat_template import detect_chat_template, get_chat_template
from radixlm.frontend_lang.choices import decide, greedy_token_selection, token_length_normalized
from radixlm.frontend_lang.interpreter import PromptBuilder
from radixlm.frontend_lang.ir import (
    REGEX_INT,
    SglConstantText,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    default_sampling_params,
    leaves,
    produced_var_names,
)
from radixlm.frontend_lang.lint import PrefixCacheLintWarning, find_dynamic_prefix
from radixlm.frontend_lang.tracer import (
    Placeholder,
    batch_shared_prefix,
    placeholder_arguments,
    split_segments,
    trace_program,
)

CHATML = get_chat_template("chatml")
LONG_RULES = "You are a careful assistant. Follow these rules exactly. " * 20  # ~1,100 chars
HF_CHATML_JINJA = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
)


# ------------------------------------------------------------------------ IR
def test_expression_concatenation_flattens_in_order():
    expr = "Q: " + sgl.gen("a", max_tokens=4) + "\n" + sgl.select("b", choices=["x", "y"])
    kinds = [type(leaf) for leaf in leaves(expr)]
    assert kinds == [SglConstantText, SglGen, SglConstantText, SglSelect]
    assert produced_var_names(expr) == ["a", "b"]


def test_roles_wrap_their_content():
    expr = sgl.user("hi" + sgl.gen("x"))
    kinds = [type(leaf) for leaf in leaves(expr)]
    assert kinds == [SglRoleBegin, SglConstantText, SglGen, SglRoleEnd]
    assert isinstance(sgl.assistant(), SglExprList)
    assert sgl.system_begin().role == "system" and sgl.assistant_end().role == "assistant"


def test_gen_with_choices_is_select_and_select_validates():
    expr = sgl.gen("c", choices=["yes", "no"])
    assert isinstance(expr, SglSelect) and expr.temperature == 0.0
    with pytest.raises(ValueError):
        sgl.select("c", choices=[])
    with pytest.raises(ValueError):
        sgl.select("c", choices=["ok", ""])
    with pytest.raises(re.error):
        sgl.gen("bad", regex="(unclosed")


def test_sampling_params_merge_and_request_fields():
    defaults = default_sampling_params(max_new_tokens=64, temperature=0.0)
    merged = defaults.merged(SglSamplingParams(max_new_tokens=8, stop="\n"))
    srt = merged.to_srt_kwargs()
    assert srt["max_new_tokens"] == 8 and srt["temperature"] == 0.0 and srt["stop"] == "\n"
    assert "regex" not in srt and "json_schema" not in srt
    assert merged.logprob_kwargs() == {}
    with_lp = merged.merged(SglSamplingParams(return_logprob=True, logprob_start_len=3))
    assert with_lp.logprob_kwargs() == {"return_logprob": True, "logprob_start_len": 3}


def test_dtype_int_becomes_a_regex_and_stops():
    params = SglSamplingParams(dtype=int, stop="END").resolve_dtype()
    assert params.regex == REGEX_INT and params.dtype is None
    assert params.stop_list() == ["END", " ", "\n"]
    assert SglSamplingParams(dtype="bool").resolve_dtype().regex == "(True|False)"
    with pytest.raises(ValueError):
        SglSamplingParams(dtype=list).resolve_dtype()
    schema = SglSamplingParams(json_schema={"type": "object"}).to_srt_kwargs()["json_schema"]
    assert json.loads(schema) == {"type": "object"}


# ------------------------------------------------------------ chat templates
def test_chatml_rendering_matches_the_hf_jinja_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}]
    expected = jinja2.Template(HF_CHATML_JINJA).render(messages=messages)
    assert CHATML.get_prompt(messages) == expected


def test_prompt_builder_renders_roles_and_counts_messages():
    b = PromptBuilder(CHATML)
    for role, text in [("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2")]:
        b.role_begin(role)
        b.fill(text)
        b.role_end(role)
    assert len(b.messages_) == 4
    assert b.text_ == CHATML.get_prompt(b.messages_)
    with pytest.raises(ValueError):
        b.role_end("user")
    b.role_begin("user")
    with pytest.raises(ValueError):
        b.role_begin("assistant")


def test_qwen_inserts_its_default_system_prompt_and_llama3_alias():
    b = PromptBuilder(get_chat_template("qwen"))
    b.role_begin("user")
    b.fill("hi")
    b.role_end("user")
    assert b.messages_[0] == {"role": "system", "content": "You are a helpful assistant."}
    llama3 = get_chat_template("llama-3")
    assert llama3.name == "llama-3-instruct"
    assert llama3.get_prompt([{"role": "user", "content": "x"}]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>")
    assert get_chat_template("default").get_prompt([{"role": "user", "content": "x"}]) == "USER:x\n"
    with pytest.raises(ValueError):
        get_chat_template("no-such-template")


def test_detect_chat_template_from_tokenizer_files(tmp_path):
    chatml_dir = tmp_path / "tiny-model"
    chatml_dir.mkdir()
    (chatml_dir / "chat_template.jinja").write_text(HF_CHATML_JINJA)
    assert detect_chat_template({"model_path": str(chatml_dir), "tokenizer_path": str(chatml_dir)}).name == "chatml"
    llama_dir = tmp_path / "other"
    llama_dir.mkdir()
    (llama_dir / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "<|start_header_id|>{{ m }}<|end_header_id|><|eot_id|>"}))
    assert detect_chat_template({"tokenizer_path": str(llama_dir)}).name == "llama-3-instruct"
    # no readable tokenizer: fall back to the path name, then to default
    assert detect_chat_template({"model_path": "/x/Qwen2-7B-Instruct"}).name == "qwen"
    assert detect_chat_template({"model_path": "/x/Meta-Llama-3-8B-Instruct"}).name == "llama-3-instruct"
    assert detect_chat_template({"model_path": "/x/some-base-model"}).name == "default"


# -------------------------------------------------------------------- tracer
@sgl.function
def cache_friendly(s, question):
    s += sgl.system(LONG_RULES)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


@sgl.function
def dynamic_front(s, today, question):
    s += sgl.system(f"Today is {today}. " + LONG_RULES)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


def test_placeholders_survive_fstrings_and_mark_the_prefix():
    trace = trace_program(dynamic_front.func, placeholder_arguments(dynamic_front.func, {}), CHATML)
    assert trace.stopped is None
    assert trace.constant_prefix == "<|im_start|>system\nToday is "
    kinds = [seg.kind for seg in trace.segments()]
    assert kinds[:3] == ["constant", "argument", "constant"] and "generated" in kinds
    names = [seg.name for seg in trace.segments() if seg.kind == "argument"]
    assert names == ["today", "question"]


def test_constant_prefix_of_a_cache_friendly_program_is_the_rendered_system_turn():
    trace = cache_friendly.trace()
    assert trace.constant_prefix == get_chat_template("default").get_prompt(
        [{"role": "system", "content": LONG_RULES}]) + "USER:"


def test_trace_stops_at_fork_and_records_program_errors():
    @sgl.function
    def forks(s, topic):
        s += "Constant intro. "
        s.fork(2)
        s += "never reached"

    @sgl.function
    def breaks(s, n):
        s += "Before. "
        for _ in range(n):  # a str placeholder is not a number
            s += "x"

    assert forks.trace().text == "Constant intro. " and forks.trace().stopped == "fork"
    broken = breaks.trace()
    assert broken.text == "Before. " and broken.stopped.startswith("TypeError")


def test_batch_prefix_is_trimmed_by_argument_dependent_branches():
    @sgl.function
    def by_language(s, lang, q):
        s += "Shared header. " * 10
        s += "Réponds en français. " if lang == "fr" else "Answer in English. "
        s += q + sgl.gen("a")

    batch = [{"lang": "en", "q": "a?"}, {"lang": "fr", "q": "b?"}]
    prefix, trace = batch_shared_prefix(by_language.func, batch, CHATML)
    assert prefix == "Shared header. " * 10
    # with only English calls the branch text is shared too
    prefix_en, _ = batch_shared_prefix(by_language.func, [{"lang": "en", "q": "a?"}] * 3, CHATML)
    assert prefix_en == "Shared header. " * 10 + "Answer in English. "


def test_defaulted_arguments_not_passed_stay_constant():
    def prog(s, q, style="short"):
        s += "Style: " + style + ". " + q

    args = placeholder_arguments(prog, {}, dynamic={"q"})
    assert "style" not in args and isinstance(args["q"], Placeholder)
    assert trace_program(prog, args, CHATML).constant_prefix == "Style: short. "
    args = placeholder_arguments(prog, {}, dynamic={"q", "style"})
    assert trace_program(prog, args, CHATML).constant_prefix == "Style: "


def test_split_segments_handles_broken_markers():
    text = "abc" + Placeholder("x")[:2] + "def"
    segs = split_segments(text)
    assert [s.kind for s in segs] == ["constant", "argument", "constant"]
    assert "".join(text[s.start:s.end] for s in segs) == text


# ---------------------------------------------------------------------- lint
def test_lint_warns_once_on_dynamic_prefix():
    @sgl.function
    def stamped(s, now, question):
        s += "Time: " + now + "\n"
        s += LONG_RULES
        s += question + sgl.gen("a")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stamped.trace()
        stamped.trace()
    lint = [w for w in caught if issubclass(w.category, PrefixCacheLintWarning)]
    assert len(lint) == 1
    msg = str(lint[0].message)
    assert "'stamped'" in msg and "'now'" in msg and "character 6" in msg
    assert "test_dsl_unit.py:" in msg


def test_lint_silent_on_cache_friendly_program_and_short_tails():
    @sgl.function
    def short_tail(s, question):
        s += LONG_RULES + "Question: " + question + "\nAnswer briefly in one line:" + sgl.gen("a")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache_friendly.trace()
        short_tail.trace()
    assert not [w for w in caught if issubclass(w.category, PrefixCacheLintWarning)]


def test_lint_ignores_constant_text_after_the_first_generation():
    def prog(s, q):
        s += q + sgl.gen("a") + LONG_RULES

    trace = trace_program(prog, placeholder_arguments(prog, {}), CHATML)
    assert find_dynamic_prefix(trace, "prog") is None
    issue = find_dynamic_prefix(trace_program(dynamic_front.func, placeholder_arguments(
        dynamic_front.func, {}), CHATML), "dynamic_front")
    assert issue is not None and issue.argument == "today"
    assert issue.constant_end - issue.constant_start >= len(LONG_RULES)


# ------------------------------------------------------ select span alignment
def _result(prompt_tokens: int, ids: list[int], logprobs: list[float | None]) -> dict:
    entries = [[lp, tid, f"t{tid}"] for lp, tid in zip(logprobs, ids, strict=True)]
    return {"meta_info": {"prompt_tokens": prompt_tokens, "input_token_logprobs": entries}}


def test_choice_span_without_a_boundary_merge():
    # prompt tokens [.., 7, 8, 9] (P=10), window from 7; choice adds tokens 50, 51
    prompt = _result(10, [7, 8, 9], [-1.0, -1.0, -1.0])
    choice = _result(12, [7, 8, 9, 50, 51], [-1.0, -1.0, -1.0, -0.5, -1.5])
    (span,) = choice_spans(prompt, [choice])
    assert [e[1] for e in span] == [50, 51]
    assert token_length_normalized(choices=["c"], normalized_prompt_logprobs=[-1.0], input_token_logprobs=[span],
                                   output_token_logprobs=[[]]).decision == "c"


def test_choice_span_with_a_merge_at_the_boundary():
    # the prompt's last token 9 merges with the choice into 60: the span starts one position earlier
    prompt = _result(10, [7, 8, 9], [-1.0, -1.0, -1.0])
    choice = _result(11, [7, 8, 60, 61], [-1.0, -1.0, -2.0, -0.1])
    (span,) = choice_spans(prompt, [choice])
    assert [e[1] for e in span] == [60, 61]


def test_choice_span_needs_a_wider_window_when_the_merge_reaches_its_start():
    prompt = _result(10, [8, 9], [-1.0, -1.0])
    choice = _result(10, [70, 71], [-1.0, -1.0])
    assert choice_spans(prompt, [choice]) is None
    # at the start of the prompt nothing earlier exists: the span is the whole window (None logprob kept)
    prompt0 = _result(2, [8, 9], [None, -1.0])
    choice0 = _result(2, [70, 71], [None, -1.0])
    assert [e[1] for e in choice_spans(prompt0, [choice0])[0]] == [70, 71]


def test_decide_argmax_greedy_and_temperature():
    scores = dict(choices=["a", "b"], normalized_prompt_logprobs=[-2.0, -1.0],
                  input_token_logprobs=[[[-2.0, 1, "a"]], [[-1.0, 2, "b"]]], output_token_logprobs=[[], []])
    assert decide(token_length_normalized, 0.0, **scores).decision == "b"
    assert decide(greedy_token_selection, 0.0, **scores).decision == "b"
    picks = {decide(token_length_normalized, 50.0, rng=random.Random(i), **scores).decision for i in range(40)}
    assert picks == {"a", "b"}
    with pytest.raises(ValueError):
        decide(greedy_token_selection, 1.0, **scores)


# ------------------------------------------------------- wire-format helpers
def test_iter_sse_stops_at_done_and_raises_stream_errors():
    lines = ['data: {"text": "a", "meta_info": {}}', "", ": comment", 'data: {"text": "ab", "meta_info": {}}',
             "data: [DONE]", 'data: {"text": "never"}']
    assert [o["text"] for o in iter_sse(iter(lines))] == ["a", "ab"]
    with pytest.raises(sgl.BackendError, match="boom"):
        list(iter_sse(iter(['data: {"error": {"message": "boom"}}'])))


def test_error_from_response_carries_the_server_message():
    resp = httpx.Response(400, json={"error": {"message": "temperature must be >= 0", "type": "BadRequest"}})
    err = error_from_response(resp)
    assert err.status_code == 400 and err.message == "temperature must be >= 0"
    assert "temperature must be >= 0" in str(err)
    assert error_from_response(httpx.Response(500, text="plain failure")).message == "plain failure"


def test_runtime_cli_args_and_unknown_server_args():
    args = server_cli_args({"model_path": "/m", "port": 123, "disable_radix_cache": True,
                            "log_requests": False, "chat_template": None})
    assert args == ["--model-path", "/m", "--port", "123", "--disable-radix-cache"]
    with pytest.raises(TypeError, match="no_such_flag"):
        sgl.Runtime(model_path="/m", no_such_flag=1)


def test_openai_select_matching():
    choices = ["Paris", "London", "Par"]
    assert match_choice(" Paris\n", choices) == (0, "exact")
    assert match_choice("London is the answer", choices) == (1, "prefix")
    assert match_choice("Parisian", choices) == (0, "prefix")  # longest choice it starts with
    assert match_choice("lond", choices)[0] == 1


def test_public_names_exist():
    for name in ["function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant",
                 "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
                 "set_default_backend", "RuntimeEndpoint", "Runtime", "OpenAI"]:
        assert hasattr(sgl, name), name
    with pytest.raises(ValueError, match="first argument"):
        sgl.function(lambda x: None)
