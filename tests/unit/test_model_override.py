"""--json-model-override-args (SGLang's flag): config.json fields replaced at load. Cutting
num_hidden_layers gives the model HF builds from the same folder with the same override (greedy
tokens identical in fp32), with the later layers' weights skipped; bad values are clear errors."""

from __future__ import annotations

import pytest
import torch
from helpers import SchedulerHarness, random_prompts

from radixlm.runtime.models.model_config import ModelConfig, ModelLoadError
from radixlm.runtime.server_args import ServerArgs


def test_fewer_layers_match_hf_with_the_same_override(llama_path: str) -> None:
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(2, 1900, seed=11, lo=5, hi=20)
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32, num_hidden_layers=1).eval()
    assert hf.config.num_hidden_layers == 1
    refs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=6,
                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    h = SchedulerHarness(llama_path, json_model_override_args='{"num_hidden_layers": 1}')
    assert h.scheduler.runner.model_config.num_layers == 1
    assert len(h.scheduler.runner.model.model.layers) == 1
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, max_new_tokens=6, temperature=0, ignore_eos=True)
    res = h.run()
    assert [res[f"r{i}"]["output_ids"] for i in range(2)] == refs
    full = ModelConfig.from_path(llama_path)
    assert full.num_layers > 1                   # the override, not the folder, made it one layer


@pytest.mark.parametrize("value, message", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_override_that_is_not_a_json_object_is_rejected(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs.from_kwargs(json_model_override_args=value).validate()


def test_override_of_the_wrong_type_is_a_load_error(llama_path: str) -> None:
    with pytest.raises(ModelLoadError, match="json-model-override-args"):
        ModelConfig.from_path(llama_path, overrides={"num_hidden_layers": "many"})
    assert ModelConfig.from_path(llama_path, overrides={"rms_norm_eps": 1e-3}).rms_norm_eps == 1e-3


def test_override_flag_parses_from_the_command_line() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--json-model-override-args", '{"num_hidden_layers": 2}']))
    assert args.model_overrides == {"num_hidden_layers": 2}
    assert ServerArgs().model_overrides == {}
