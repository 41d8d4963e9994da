"""GPU-only checks (``pytest -m gpu``; ``make gpu-check`` runs them on a borrowed GPU machine).

Skipped without CUDA, so CI (CPU) collects and skips them. Measured numbers go into the junit
XML as properties (``record_property``) and ``tests/gpu/check.py`` writes them to its JSON.
Written without a GPU to run them on (none was lent while they were written): the bounds below
are the claims to check, not values seen on hardware.

1. SDPA and megatron's local attention on CUDA (fp32, TF32 off; bf16) vs the CPU fp32 result,
   forward and input gradients; bf16 SDPA with GQA runs torch's flash kernel.
2. bf16 memory of one llama3_8b layer (TP1) at seq 8192: SDPA's saved activations agree with
   the planner's memory model (``layout.memory``) and stay far below megatron's local
   attention's, which materialises ``[heads, s, s]`` probabilities.
3. Phase timers (``train.step.clock``): the optimizer's queued GPU work is counted as
   optimizer time, not as the next step's compute.
4. The straggler probe is compute-bound on the GPU: twice its work takes about twice its time,
   and repeated probes agree, so a GPU slower by ``nutp.straggler_threshold`` is seen.
5. Hang blame's device progress (``health.watch.CollectiveLog`` with ``device_event``):
   a collective queued behind a long kernel is entered on the host at once but counted as
   reached only when the device gets there.
6. ``parallel/comm.py``'s device-event timing of collectives: an op queued behind a long
   kernel counts only its own device interval (issue #36).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda", 0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def test_attention_cuda_matches_cpu(record_property: Any) -> None:
    from tests.helpers.attention import attention_pair, run_pair, setup

    setup()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref_cpu, sdpa_cpu = run_pair(8, 2, s=256, b=2, d=64)
    ref_gpu, sdpa_gpu = run_pair(8, 2, s=256, b=2, d=64, device="cuda")
    worst = {"megatron_fp32": max(_rel(a, b) for a, b in zip(ref_gpu, ref_cpu, strict=True)),
             "sdpa_fp32": max(_rel(a, b) for a, b in zip(sdpa_gpu, ref_cpu, strict=True))}
    ref_bf, sdpa_bf = run_pair(8, 2, s=256, b=2, d=64, device="cuda", dtype=torch.bfloat16)
    worst["megatron_bf16"] = max(_rel(a, b) for a, b in zip(ref_bf, ref_cpu, strict=True))
    worst["sdpa_bf16"] = max(_rel(a, b) for a, b in zip(sdpa_bf, ref_cpu, strict=True))
    for k, v in worst.items():
        record_property(f"rel_err_{k}", v)
    assert worst["megatron_fp32"] < 1e-5 and worst["sdpa_fp32"] < 1e-5, worst
    assert worst["megatron_bf16"] < 3e-2 and worst["sdpa_bf16"] < 3e-2, worst
    assert max(_rel(a, b) for a, b in zip(sdpa_cpu, ref_cpu, strict=True)) < 1e-6
    # bf16 GQA runs on torch's flash kernel (no fallback to the math kernel's [s, s] scores)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, sdpa = attention_pair(8, 2, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1024, 2, 8, 64, device=CUDA, dtype=torch.bfloat16)
    kv = torch.randn(1024, 2, 2, 64, device=CUDA, dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = sdpa(q, kv, kv, attention_mask=None)
    assert out.shape == (1024, 2, 512)


def _one_rank_groups() -> Any:
    """A one-rank NCCL world and this project's groups for a TP1 plan of one layer."""
    import torch.distributed as dist

    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan
    from nemo_nutp.parallel import build_groups
    from tests.helpers.dist import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.cuda.set_device(CUDA)
        dist.init_process_group("nccl", rank=0, world_size=1)
    plan = build_plan(PlanRequest(cluster=ClusterSpec(num_gpus=1, domain_size=1,
                                                      gpus_per_node=1),
                                  parallel=ParallelSpec(tp_base=1), global_batch=1))
    return build_groups(plan)


def _layer_peak(core: str, dims: Any) -> dict[str, float]:
    """Saved activations and peak of one bf16 layer's forward + backward at TP1."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.spec_utils import build_module

    from nemo_nutp.model.build import nutp_layer_spec, transformer_config

    groups = _one_rank_groups()
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    config = transformer_config(dims, degree=1, precision="bf16")
    spec = nutp_layer_spec(dims, degree=1, tp_rank=0, tp_group=groups.pgs.tp,
                           core_attention=core)
    layer = build_module(spec, config=config, layer_number=1,
                         pg_collection=groups.pgs).to(CUDA)
    with torch.no_grad():  # built without initialisation (megatron's perform_initialization)
        for p in layer.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    s, h = dims.seq_length, dims.hidden_size
    x = torch.randn(s, 1, h, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    mask = (torch.triu(torch.ones(s, s, dtype=torch.bool, device=CUDA), 1)[None, None]
            if core == "megatron" else None)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(dims.kv, rotary_percent=1.0).to(CUDA)(s)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = layer(x, attention_mask=mask, rotary_pos_emb=rope)
    out = out[0] if isinstance(out, tuple) else out
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.float().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del layer, out, x
    torch.cuda.empty_cache()
    return {"saved_gib": saved / 2 ** 30, "peak_gib": peak / 2 ** 30}


def test_llama3_8b_layer_bf16_memory_at_seq_8192(record_property: Any) -> None:
    import dataclasses

    from nemo_nutp.config.recipes import load_recipe
    from nemo_nutp.layout.memory import GIB, MemorySpec, layer_activation_bytes

    dims = dataclasses.replace(load_recipe("llama3_8b_h100").model, num_layers=1)
    assert dims.seq_length == 8192
    sdpa = _layer_peak("sdpa", dims)
    local = _layer_peak("megatron", dims)
    model = layer_activation_bytes(dims, 1, MemorySpec(gpu_memory_gib=80)) / GIB
    model_local = layer_activation_bytes(
        dims, 1, MemorySpec(gpu_memory_gib=80, flash_attention=False)) / GIB
    for k, v in {**{f"sdpa_{k}": v for k, v in sdpa.items()},
                 **{f"megatron_{k}": v for k, v in local.items()},
                 "model_saved_gib": model, "model_saved_megatron_gib": model_local}.items():
        record_property(k, v)
    assert 0.6 * model <= sdpa["saved_gib"] <= 1.5 * model, (sdpa, model)
    assert local["saved_gib"] > sdpa["saved_gib"] + 3.0, (local, sdpa)  # 32 x 8192^2 bf16
    assert sdpa["peak_gib"] < 8.0, sdpa


class _Model(torch.nn.Module):
    """The parts of a NUTP DDP model ``train_step`` touches, over one linear layer."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64, device=device)

    def forward(self, tokens: torch.Tensor, *_: Any, labels: Any = None) -> torch.Tensor:
        return self.lin(tokens.float())

    def zero_grad_buffer(self) -> None:
        self.zero_grad()

    def no_sync(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        pass


class _Optimizer:
    """An optimizer whose step queues ``gpu_s`` of GPU work and returns at once."""

    def __init__(self, device: torch.device, matmuls: int) -> None:
        self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) / 64.0
        self.matmuls = matmuls

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)

    def zero_grad(self) -> None:
        pass

    def prepare_grads(self) -> bool:
        return False

    def get_grad_norm(self) -> float:
        return 1.0

    def step_with_ready_grads(self) -> None:
        x = self.a
        for _ in range(self.matmuls):
            x = torch.tanh(x @ self.a)


def test_cuda_phase_timers_count_the_optimizer_gpu_time(record_property: Any) -> None:
    from nemo_nutp.data import MicroBatch
    from nemo_nutp.train.step import train_step

    model, opt = _Model(CUDA), _Optimizer(CUDA, matmuls=2000)  # ~0.3-0.5 s on an H100/H200
    t = torch.zeros(2, 8, 64, device=CUDA)
    mb = MicroBatch(tokens=t, position_ids=t, labels=t)
    train_step(model, opt, [mb], None)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step_with_ready_grads()
    launch = time.perf_counter() - t0
    torch.cuda.synchronize()
    gpu = time.perf_counter() - t0
    _, _, times, _ = train_step(model, opt, [mb], None)
    t1 = time.perf_counter()
    train_step(model, opt, [mb], None)
    record_property("optimizer_gpu_s", gpu)
    record_property("optimizer_launch_s", launch)
    for k, v in times.items():
        record_property(k, v)
    assert gpu > 5 * launch, (gpu, launch)  # the work is queued, not done, at return
    assert times["optimizer_s"] >= 0.8 * gpu, times  # counted where it ran
    assert times["compute_s"] < 0.2 * gpu, times  # not in the next phase
    assert time.perf_counter() - t1 > 0.8 * gpu


def test_straggler_probe_is_compute_bound(record_property: Any) -> None:
    from nemo_nutp.train.stragglers import StragglerDetector

    cfg = SimpleNamespace(
        nutp=SimpleNamespace(straggler_probe_interval=1, straggler_threshold=1.5,
                             straggler_window=3, exclude_stragglers=False),
        output=SimpleNamespace(dir="/tmp"), checkpoint=SimpleNamespace(interval=0))
    plan = SimpleNamespace(world_size=1, tp_groups=lambda: [[0]])
    det = StragglerDetector(cfg, plan, rank=0, events="/dev/null", device=CUDA)
    det.probe(1.0)  # warm-up (cuBLAS handles, clocks)
    once = [det.probe(1.0) for _ in range(3)]
    det.iters *= 2
    twice = [det.probe(1.0) for _ in range(3)]
    det.iters //= 2
    slow = det.probe(1.5)  # the injected slowdown stretches it like a slower GPU would
    ratio = min(twice) / min(once)
    spread = max(once) / min(once)
    for k, v in {"probe_s": min(once), "probe_2x_work_s": min(twice), "work_ratio": ratio,
                 "spread": spread, "probe_slow1.5_s": slow}.items():
        record_property(k, v)
    assert min(once) > 1e-3, once  # not launch-bound (192 x 192 was ~us on an H100)
    assert 1.7 < ratio < 2.3, (once, twice)
    assert spread < 1.1, once
    assert slow > 1.4 * min(once)


def test_distributed_optimizer_inner_adam_is_fused_on_cuda(record_property: Any) -> None:
    from megatron.core.optimizer import OptimizerConfig

    from nemo_nutp.sync.zero import _inner_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    w0, g = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    out = {}
    for name, dev in (("cpu", torch.device("cpu")), ("cuda", CUDA)):
        p = torch.nn.Parameter(w0.clone().to(dev))
        opt = _inner_optimizer(cfg, [{"params": [p]}], cuda=dev.type == "cuda")
        for _ in range(3):
            p.grad = g.to(dev)
            opt.step()
        out[name] = (p.detach().cpu(), type(opt))
    cls = out["cuda"][1]
    record_property("cuda_inner_optimizer", f"{cls.__module__}.{cls.__name__}")
    # megatron's FusedAdam (TE / apex), or torch's fused CUDA kernel without them
    cuda_opt = _inner_optimizer(cfg, [{"params": [torch.nn.Parameter(w0.to(CUDA))]}], cuda=True)
    assert cls.__module__.startswith(("transformer_engine", "apex")) or \
        cuda_opt.defaults.get("fused") is True, cuda_opt.defaults
    assert _rel(out["cuda"][0], out["cpu"][0]) < 1e-6


def test_collective_log_counts_what_the_device_reached(record_property: Any) -> None:
    from nemo_nutp.health.watch import CollectiveLog, device_event

    torch.cuda.set_device(CUDA)
    log = CollectiveLog(event=device_event())
    group = SimpleNamespace(group_name="7")
    op = log.wrap(lambda tensor, group=None: tensor.add_(1))
    x = torch.zeros(1, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a kernel that keeps the device busy for ~a second
    t0 = time.perf_counter()
    op(x, group=group)
    op(x, group=group)
    host_s = time.perf_counter() - t0
    behind = log.counts()
    torch.cuda.synchronize()
    caught_up = log.counts()
    record_property("host_enter_s", host_s)
    assert log.entered == {"7": 2} and host_s < 0.1  # the host returned at once
    assert behind == {"7": 0}, behind  # the device had not reached the first one
    assert caught_up == {"7": 2}, caught_up


def test_comm_times_collectives_on_the_device(record_property: Any) -> None:
    """``parallel/comm.py`` under NCCL times an op by device events (issue #36 item 1): an
    all-reduce queued behind a ~1 s kernel is in flight on the host for that second, but its
    device interval is the all-reduce's alone; the rank's rate comes from the device time."""
    import torch.distributed as dist

    from nemo_nutp.parallel.comm import Comm, Domains

    _one_rank_groups()  # a one-rank NCCL world
    comm = Comm(Domains((0,), 1), rank=0)
    x = torch.ones(1 << 22, device=CUDA)  # 16 MB
    comm.all_reduce(x, group=None)  # warm-up: NCCL's communicator
    torch.cuda.synchronize()
    comm.take_step()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time ahead of the collective
    t0 = time.perf_counter()
    h = comm.all_reduce(x, group=None, async_op=True)
    h.wait()
    torch.cuda.synchronize()
    host_s = time.perf_counter() - t0
    deadline = time.monotonic() + 10
    while True:  # the helper thread finds the end event
        lanes = [s for s in comm.take_step().lanes if s.nbytes]
        if lanes or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    comm.close()
    (lane,) = lanes
    record_property("host_s", host_s)
    record_property("device_s", lane.busy_s)
    assert dist.get_backend() == "nccl" and lane.nbytes == x.numel() * 4
    assert host_s > 0.3, host_s  # the kernel ran first
    assert 0.0 < lane.busy_s < 0.1 * host_s, (lane.busy_s, host_s)
