"""How much memory the experts can have, before anything is loaded: what is available (this cgroup's
headroom or MemAvailable; on CUDA, the device's free memory), less the process floor, the dense part,
the KV reservation and a margin. Sizes come from the config and the safetensors headers alone. Knows no
policy and moves nothing; what a budget buys in slots is the store's business."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moestream.budget import Budget, format_bytes
from moestream.cgroup import own_cgroup
from moestream.errors import BudgetError

MIB = 2**20
FLAG = "--host-budget"
FLOOR_BYTES = 512 * MIB  # Python + torch + transformers + the family's module (measured 385-450 MiB: docs/measurements/memory.md)
MIN_MARGIN_BYTES = 256 * MIB  # activations, policy state, allocator slack
MARGIN_SHARE = 0.05  # of what is available, when that is more
CUDA_MARGIN_BYTES = 1024 * MIB  # CUDA workspaces and activations beside the device tier
AUTO = "auto"


@dataclass(frozen=True)
class ModelSizes:
    dense_bytes: int  # every tensor that is not a routed expert
    expert_bytes: int  # one routed expert
    num_experts: int  # routed experts in all layers
    num_moe_layers: int
    top_k: int
    kv_bytes_per_token: int  # estimated from the config

    @property
    def total_expert_bytes(self) -> int:
        return self.expert_bytes * self.num_experts


@dataclass(frozen=True)
class Available:
    num_bytes: int
    source: str  # where the figure was read, e.g. "MemAvailable" or "cuda:0 free"


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    device_memory: Available  # where the dense part and the device tier live
    host_memory: Available
    sizes: ModelSizes
    kv_bytes: int
    expert_budget_bytes: int  # the device tier
    host_budget_bytes: int  # the host tier (0 on the CPU: host and device are one memory there)

    def lines(self) -> list[str]:
        """The plan as a person reads it: what fits where, and the bytes a token may read."""
        s, on_cuda = self.sizes, self.device.startswith("cuda")
        out = [f"{self.device_memory.source}: {format_bytes(self.device_memory.num_bytes)} available"]
        if on_cuda:
            out.append(f"host ({self.host_memory.source}): {format_bytes(self.host_memory.num_bytes)} available")
        out += [f"  process floor {format_bytes(FLOOR_BYTES)} (host), dense part {format_bytes(s.dense_bytes)}, "
                f"KV {format_bytes(self.kv_bytes)} ({format_bytes(s.kv_bytes_per_token)} a token, estimated), "
                f"margin {format_bytes(margin(self.device_memory.num_bytes, on_cuda))}",
                _tier("expert budget (device tier)", self.expert_budget_bytes, s)]
        if on_cuda:
            out.append(_tier("host budget (host tier)", self.host_budget_bytes, s))
        held = min(1.0, (self.expert_budget_bytes + self.host_budget_bytes) / s.total_expert_bytes)
        routed = s.num_moe_layers * s.top_k * s.expert_bytes
        return out + [f"a token routes {format_bytes(routed)} of experts; with {100 * held:.0f}% of them held, about "
                      f"{format_bytes(int(routed * (1 - held)))} a token from disk if routing were uniform (LRU); "
                      "predictive policies on real routing read less, and `moestream sim` measures it on a trace"]


def _tier(label: str, num_bytes: int, sizes: ModelSizes) -> str:
    experts = num_bytes // sizes.expert_bytes
    return (f"  {label}: {format_bytes(num_bytes)} = {experts} experts of {format_bytes(sizes.expert_bytes)}, "
            f"{100 * num_bytes / sizes.total_expert_bytes:.1f}% of {sizes.num_experts}")


def margin(available_bytes: int, on_cuda: bool) -> int:
    return max(CUDA_MARGIN_BYTES if on_cuda else MIN_MARGIN_BYTES, int(MARGIN_SHARE * available_bytes))


def host_available() -> Available:
    """MemAvailable, or this cgroup's headroom where that is less."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    free = Available(int(meminfo["MemAvailable"].split()[0]) * 1024, "MemAvailable")
    group = own_cgroup()
    headroom = group.headroom_bytes() if group else None
    return free if headroom is None or headroom >= free.num_bytes else Available(headroom, f"{group.label} headroom")


def plan_memory(sizes: ModelSizes, device: str, kv_bytes: int, host: Available | None = None,
                gpu: Available | None = None) -> MemoryPlan:
    """The largest budgets leaving floor, dense part, KV and margin; refused below one layer's top_k experts."""
    host = host or host_available()
    if not device.startswith("cuda"):
        left = host.num_bytes - FLOOR_BYTES - sizes.dense_bytes - kv_bytes - margin(host.num_bytes, False)
        return MemoryPlan(device, host, host, sizes, kv_bytes, _fit(left, sizes, host), 0)
    if gpu is None:
        import torch

        index = torch.device(device).index or 0
        gpu = Available(int(torch.cuda.mem_get_info(index)[0]), f"cuda:{index} free")
    left = gpu.num_bytes - sizes.dense_bytes - kv_bytes - margin(gpu.num_bytes, True)
    expert = _fit(left, sizes, gpu)
    host_left = host.num_bytes - FLOOR_BYTES - margin(host.num_bytes, False)
    host_budget = max(0, min(host_left, sizes.total_expert_bytes - expert))
    return MemoryPlan(device, gpu, host, sizes, kv_bytes, expert, host_budget)


def _fit(left_bytes: int, sizes: ModelSizes, available: Available) -> int:
    needed = sizes.top_k * sizes.expert_bytes
    if left_bytes < needed:
        raise BudgetError(f"--expert-budget auto: {format_bytes(available.num_bytes)} available "
                          f"({available.source}) leaves {format_bytes(max(0, left_bytes))} for experts after the "
                          f"floor, dense part, KV and margin; one layer's top_k needs {format_bytes(needed)}")
    return min(left_bytes, sizes.total_expert_bytes)


def model_sizes(path: Path) -> ModelSizes:
    """A checkpoint's sizes from its config and safetensors headers (nothing is read beyond them)."""
    from moestream.checkpoint.index import build_index

    return sizes_of(build_index(path))


def sizes_of(index) -> ModelSizes:
    """The sizes of an indexed checkpoint (`checkpoint.index.CheckpointIndex`)."""
    topology = index.topology
    dense = sum(index.tensors[name].nbytes for name in index.dense_names())
    return ModelSizes(dense, topology.expert_bytes, topology.total_experts, topology.num_layers,
                      topology.top_k, kv_bytes_per_token(index.config))


def kv_bytes_per_token(config) -> int:
    """Keys and values of one token in every attention layer (an estimate: compressed or windowed caches hold less)."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "num_decoder_layers", None) or config.num_layers
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None) or config.num_heads
    if getattr(config, "qk_nope_head_dim", None):  # latent attention: transformers caches full heads
        heads = config.num_attention_heads
        width = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None)
        width = 2 * (head_dim or config.hidden_size // config.num_attention_heads)
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    return layers * heads * width * (4 if "32" in dtype else 2)


def host_bytes(text, expert_bytes: int, num_experts: int) -> int:
    """The bytes of the host tier a budget buys: whole expert slots, at most every expert."""
    slots = min(Budget.parse(text, FLAG).resolve(expert_bytes * num_experts) // expert_bytes, num_experts)
    return slots * expert_bytes


def check_host_room(text, sizes: ModelSizes, device: str, device_bytes: int, available=None, pin=None) -> None:
    """Refuses a host budget above the memory left, or whose pinned allocation fails on CUDA (available, pin:
    for tests to replace); device_bytes: the largest device budget of the runs."""
    wanted = host_bytes(text, sizes.expert_bytes, sizes.num_experts)
    if not wanted:
        return
    host = available or host_available()
    on_cpu = not device.startswith("cuda")
    held = {"the process floor": FLOOR_BYTES, "a margin": margin(host.num_bytes, False)}
    if on_cpu:  # the dense part and the device tier are host memory too
        held |= {"the dense part": sizes.dense_bytes, "the largest device budget": device_bytes}
    left = host.num_bytes - sum(held.values())
    if wanted > left:
        after = ", ".join(f"{name} {format_bytes(size)}" for name, size in held.items())
        raise BudgetError(f"{FLAG} {text}: {format_bytes(wanted)} of experts is more than the "
                          f"{format_bytes(max(left, 0))} left of {format_bytes(host.num_bytes)} available "
                          f"({host.source}) after {after}")
    if not on_cpu:
        try:
            (pin or _pin)(wanted)
        except (RuntimeError, MemoryError) as error:
            why = (str(error).strip() or type(error).__name__).splitlines()[0]
            raise BudgetError(f"{FLAG} {text}: pinning {format_bytes(wanted)} of host memory for the host tier "
                              f"failed ({why}; {format_bytes(host.num_bytes)} available, {host.source})") from None


def _pin(num_bytes: int) -> None:
    import torch

    torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)  # freed at once
