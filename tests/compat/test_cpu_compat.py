"""nemo_nutp.compat.cpu: inert with CUDA; lets megatron-core train and checkpoint on CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import free_port

_INERT_SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.util, torch
    torch.cuda.is_available = lambda: True
    from nemo_nutp.compat import cpu
    names = [m for m in cpu._SHIMMED_MODULES] + [m for m, _ in cpu._CUDA_TYPE_NAME_FUNCS]
    names += [m for m in cpu._MOE_SHIMMED_MODULES if importlib.util.find_spec(m) is not None]
    mods = {n: importlib.import_module(n) for n in names}
    rnd = mods["megatron.core.tensor_parallel.random"]
    before = {n: dict(vars(m)) for n, m in mods.items()}
    before_cls = {
        "fp16_init": mods["megatron.core.optimizer.optimizer"]
        .Float16OptimizerWithFloat16Params.__dict__["__init__"],
        "dist_build": mods["megatron.core.optimizer.distrib_optimizer"]
        .DistributedOptimizer.__dict__["_build_model_and_main_param_groups"],
    }
    tensor_type, cuda_cd = torch.Tensor.type, torch.cuda.current_device
    assert cpu.apply_cpu_patches() == [], "patched although CUDA is available"
    assert not cpu.is_patched()
    for n, m in mods.items():
        assert m.torch is torch, n
        for k, v in before[n].items():
            assert vars(m)[k] is v, (n, k)
    assert mods["megatron.core.optimizer.optimizer"].Float16OptimizerWithFloat16Params.__dict__[
        "__init__"] is before_cls["fp16_init"]
    assert mods["megatron.core.optimizer.distrib_optimizer"].DistributedOptimizer.__dict__[
        "_build_model_and_main_param_groups"] is before_cls["dist_build"]
    assert torch.Tensor.type is tensor_type and torch.cuda.current_device is cuda_cd
    assert rnd._get_cuda_rng_state.__module__ == rnd.__name__
    print("INERT-OK")
    """
)


@pytest.mark.timeout(180)
def test_inert_when_cuda_is_available() -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", _INERT_SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=170,
    )
    assert proc.returncode == 0 and "INERT-OK" in proc.stdout, proc.stdout + proc.stderr


def _build_gpt(seed: int) -> Any:
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=16,
        position_embedding_type="rope",
    )
    return config, model


def _worker(rank: int, world: int, port: int, workdir: str) -> None:
    """One TP rank: 2 train steps (DDP + Adam + clipping), then dist-checkpoint save/load."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from nemo_nutp.compat.cpu import apply_cpu_patches, cpu_attention_mask, is_patched

    patched = apply_cpu_patches()
    assert patched and is_patched() and apply_cpu_patches() == patched  # idempotent

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    config, gpt = _build_gpt(seed=1234)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=False), gpt
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [model]
    )
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128, (2, 16), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)
    mask = cpu_attention_mask(16)
    losses, norms = [], []
    for _ in range(2):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(float(loss.item()))
        norms.append(float(grad_norm))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, losses)
    assert all(g == losses for g in gathered), gathered  # both TP ranks see the same loss

    ckpt = os.path.join(workdir, "ckpt")
    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    dist_checkpointing.save(gpt.sharded_state_dict(), ckpt)
    dist.barrier()
    _, fresh = _build_gpt(seed=99)
    differs = any(not torch.equal(a, b) for a, b in zip(gpt.parameters(), fresh.parameters()))
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
    mismatched = [
        name
        for (name, a), (_, b) in zip(gpt.named_parameters(), fresh.named_parameters())
        if not torch.equal(a.detach(), b.detach())
    ]
    result = {
        "losses": losses,
        "norms": norms,
        "patched": patched,
        "fresh_differs": differs,
        "mismatched": mismatched,
    }
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_megatron_trains_and_checkpoints_on_cpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU compatibility path is only exercised on machines without CUDA")
    world = 2
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for res in results:
        l0, l1 = res["losses"]
        assert math.isfinite(l0) and math.isfinite(l1) and l1 != l0, res["losses"]
        assert l1 < l0, res["losses"]
        assert all(math.isfinite(n) and n > 0 for n in res["norms"]), res["norms"]
        assert res["fresh_differs"], "fresh model must start from different weights"
        assert res["mismatched"] == [], res["mismatched"]
        assert "megatron.core.optimizer.clip_grads.torch" in res["patched"]
    assert results[0]["losses"] == results[1]["losses"]
