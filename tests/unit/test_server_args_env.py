"""The environment registry (runtime/env.py) and the ServerArgs fields it backs.

Order: flag > environment variable > default; each switch is a flag whose help names its twin;
the launcher hands the flags to the children, where the kernels read them (checked end to end on a
scheduler child); nothing else in runtime/ or kernels/ reads os.environ.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from radixlm.runtime import env
from radixlm.runtime.entrypoints.server_info import format_fast_paths
from radixlm.runtime.server_args import ServerArgs

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p


def test_only_the_registry_reads_the_environment():
    readers = [str(p.relative_to(ROOT)) for folder in ("runtime", "kernels") for p in (ROOT / folder).rglob("*.py")
               if p != ROOT / "runtime" / "env.py" and ("os.environ" in p.read_text() or "getenv" in p.read_text())]
    assert readers == []


def test_parse_types_defaults_and_bad_values():
    assert env.DISABLE_CPU_GEMM.get({}) is False
    assert [env.DISABLE_CPU_GEMM.get({"RADIXLM_DISABLE_CPU_GEMM": v}) for v in ("1", "true", "0", "off", "")] == [
        True, True, False, False, False]
    assert env.NUM_THREADS.get({"RADIXLM_NUM_THREADS": "3"}) == 3 and env.NUM_THREADS.get({}) is None
    with pytest.raises(ValueError, match="RADIXLM_NUM_THREADS='x' is not an integer"):
        env.NUM_THREADS.get({"RADIXLM_NUM_THREADS": "x"})
    with pytest.raises(ValueError, match="RADIXLM_CPU_KERNEL_ISA='sse' is not one of avx512, avx2"):
        env.CPU_KERNEL_ISA.get({"RADIXLM_CPU_KERNEL_ISA": "sse"})
    assert all(f.startswith(("disable_", "cpu_", "require_", "num_")) for f in env.BY_FIELD)


def test_env_is_the_default_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("RADIXLM_DISABLE_FUSED_OPS", "1")
    monkeypatch.setenv("RADIXLM_NUM_THREADS", "3")
    monkeypatch.delenv("RADIXLM_CPU_KERNEL_ISA", raising=False)
    args = ServerArgs()
    assert args.disable_fused_ops and args.num_threads == 3 and args.cpu_kernel_isa is None
    cli = ServerArgs.from_cli_args(parser().parse_args(["--num-threads", "5", "--cpu-kernel-isa", "avx2"]))
    assert cli.disable_fused_ops and cli.num_threads == 5 and cli.cpu_kernel_isa == "avx2"
    assert ServerArgs.from_kwargs(disable_fused_ops=False).disable_fused_ops is False


def test_every_switch_is_a_flag_whose_help_names_its_twin():
    text = " ".join(parser().format_help().split())
    for var in env.REGISTRY.values():
        assert var.name in text
        if var.field:
            flag = "--" + var.field.replace("_", "-")
            assert flag in text and f"Env twin: {var.name}." in text
    assert "--enable-metrics Always on in radixlm" in text and "prompt_tokens_details.cached_tokens" in text


def test_child_environ_carries_the_flags(monkeypatch):
    monkeypatch.setenv("RADIXLM_DISABLE_CPU_GEMM", "1")
    monkeypatch.setenv("RADIXLM_CPU_KERNEL_ISA", "avx2")
    args = ServerArgs.from_kwargs(disable_cpu_gemm=False, cpu_kernel_isa=None, disable_cpu_decoder=True,
                                  num_threads=2)
    out = env.child_environ(args, {"RADIXLM_CPU_KERNEL_ISA": "avx2", "PATH": "/bin"})
    assert out["RADIXLM_DISABLE_CPU_GEMM"] == "0" and out["RADIXLM_DISABLE_CPU_DECODER"] == "1"
    assert out["RADIXLM_NUM_THREADS"] == "2" and "RADIXLM_CPU_KERNEL_ISA" not in out and out["PATH"] == "/bin"
    assert env.DISABLE_CPU_DECODER.get(out) and not env.DISABLE_CPU_GEMM.get(out)


def test_startup_block_lists_every_path_once():
    lines = format_fast_paths({"ISA": "avx512 (the best this CPU runs)", "CPU gemm": "off (x)"},
                              ["1 scheduler(s) x 2 torch thread(s)", "tcmalloc: preloading /x.so"])
    assert lines[0].startswith("Fast paths") and len(lines) == 5
    assert [line.split()[0] for line in lines[1:]] == ["ISA", "CPU", "threads", "preload"]


def test_cli_flag_turns_the_kernel_off_inside_the_scheduler_child(llama_path, monkeypatch):
    """--disable-fused-ops on the command line (not in this process's environment) reaches the
    kernels of the scheduler child, which reports its fast paths in the readiness handshake."""
    from radixlm.kernels.cpu_attention import load_cpu_attention
    from radixlm.runtime.entrypoints.launch import launch_subprocesses

    monkeypatch.delenv("RADIXLM_DISABLE_FUSED_OPS", raising=False)
    ns = parser().parse_args(["--model-path", llama_path, "--device", "cpu", "--dtype", "float32",
                              "--max-total-tokens", "512", "--disable-fused-ops"])
    args = ServerArgs.from_cli_args(ns).resolved()
    subs = launch_subprocesses(args)
    try:
        paths = subs.scheduler_info["fast_paths"]
    finally:
        subs.shutdown()
    assert paths["fused ops"] == "off (--disable-fused-ops / RADIXLM_DISABLE_FUSED_OPS)", paths
    assert paths["one-call decoder"] == "off (the fused CPU ops are not in use)", paths
    if load_cpu_attention() is not None:       # the other kernels stay on
        assert paths["attention kernels"].startswith("on"), paths
    assert set(paths) >= {"ISA", "CPU gemm", "packed weights", "huge pages", "torch threads"}
