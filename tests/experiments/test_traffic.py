"""experiments/traffic.py: exact counts on small programs whose cost is known by hand."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.traffic import HostSyncError, count_traffic, no_host_sync, tensor_bytes  # noqa: E402


def test_mul_then_sum_is_two_launches_with_exact_bytes():
    x = torch.randn(64, 32)                      # 8192 bytes
    r = count_traffic(lambda: (x * 2).sum())
    assert r.launches == 2
    assert r.bytes_read == 8192 + 8192           # mul reads x; sum reads x * 2
    assert r.bytes_written == 8192 + 4           # mul writes x * 2; sum writes one float
    assert {c.op: c.launches for c in r.ops.values()} == {"aten.mul.Tensor": 1, "aten.sum.default": 1}
    assert r.in_units_of(64 * 32)["bytes"] == pytest.approx((16384 + 8196) / 2048)
    assert r.host_syncs == [] and r.gemm_launches == 0


def test_views_cost_nothing_and_a_copying_reshape_is_a_clone():
    x = torch.randn(16, 8)
    r = count_traffic(lambda: (x.view(8, 16), x.t(), x.transpose(0, 1).unsqueeze(0), x[2:5], x.expand(2, 16, 8),
                               x.permute(1, 0), x.detach(), torch.empty(100), torch.empty_like(x)))
    assert r.launches == 0 and r.bytes == 0
    r = count_traffic(lambda: x.t().reshape(128))
    assert r.launches == 1 and r.bytes_read == r.bytes_written == 512
    assert "aten.clone.default" in r.ops and r.ops["aten._unsafe_view.default"].kind == "view"


def test_each_distinct_input_is_read_once_and_broadcasts_count_once():
    x = torch.randn(10, 10, dtype=torch.bfloat16)
    assert count_traffic(lambda: x * x).bytes_read == 200
    s = torch.tensor(3.0)
    assert tensor_bytes(s.expand(10, 10)) == 4
    r = count_traffic(lambda: x.float() * s.expand(10, 10))
    assert r.launches == 2
    assert r.bytes_read == 200 + (400 + 4) and r.bytes_written == 400 + 400


def test_in_place_and_out_ops_count_the_mutated_tensor():
    x = torch.randn(10, 10)
    y = torch.empty(10, 10)
    r = count_traffic(lambda: x.mul_(2))
    assert (r.launches, r.bytes_read, r.bytes_written) == (1, 400, 400)
    r = count_traffic(lambda: torch.mul(x, 2, out=y))       # out= is written, not read
    assert (r.launches, r.bytes_read, r.bytes_written) == (1, 400, 400)
    r = count_traffic(lambda: y.copy_(x))                    # copy_ overwrites: self not read
    assert (r.launches, r.bytes_read, r.bytes_written) == (1, 400, 400)
    r = count_traffic(lambda: y.zero_())
    assert (r.launches, r.bytes_read, r.bytes_written) == (1, 0, 400)
    r = count_traffic(lambda: torch.zeros_like(x))           # reads only x's shape
    assert (r.launches, r.bytes_read, r.bytes_written) == (1, 0, 400)


def test_scalar_ops_still_cost_a_launch():
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    r = count_traffic(lambda: torch.where(a > 0, a, b))
    assert r.launches == 2 and r.bytes_read == 4 + 1 + 4 + 4 and r.bytes_written == 1 + 4


def test_matmul_is_a_gemm_outside_the_totals():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    r = count_traffic(lambda: a @ b)
    assert r.launches == 0 and r.bytes == 0
    assert r.gemm_launches == 1 and r.gemm_bytes_read == 512 + 256 and r.gemm_bytes_written == 128
    w = torch.randn(4, 16)
    r = count_traffic(lambda: torch.nn.functional.linear(a, w, torch.zeros(4)))   # t (free) + addmm
    assert (r.launches, r.gemm_launches) == (1, 1)          # the zeros; addmm is the GEMM


def test_backward_ops_are_counted():
    w = torch.randn(4, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    r = count_traffic(lambda: torch.nn.functional.linear(x, w).sum().backward())
    assert r.gemm_launches == 3                  # fprop, dgrad, wgrad
    # sum (reads y: 8x4 floats), ones_like of the scalar grad; the expand is a view
    assert r.launches == 2 and r.bytes_read == 128 and r.bytes_written == 4 + 4


def test_item_is_a_host_sync_and_raises_under_no_host_sync():
    x = torch.randn(4, 4)
    r = count_traffic(lambda: (x.sum().item(), bool(x[0, 0] > 0), x.tolist(), x.nonzero(), x[x > 0]))
    names = [s.op for s in r.host_syncs]
    assert names == ["aten._local_scalar_dense.default", "aten._local_scalar_dense.default", "Tensor.tolist",
                     "aten.nonzero.default", "aten.index.Tensor"]
    assert all("test_traffic.py" in s.stack for s in r.host_syncs)
    with pytest.raises(HostSyncError, match=r"_local_scalar_dense.*test_traffic\.py"):
        with no_host_sync():
            x.sum().item()
    for read in (lambda: x.tolist(), lambda: torch.equal(x, x), lambda: bool(x.any()), lambda: x[x > 0]):
        with pytest.raises(HostSyncError):
            with no_host_sync():
                read()
    with no_host_sync(allowed=1) as seen:        # a check step: one read allowed
        y = (x * 2).amax()
        float(y)
    assert [s.op for s in seen] == ["aten._local_scalar_dense.default"]
    with pytest.raises(HostSyncError, match="host read #2 \\(1 allowed\\)"):
        with no_host_sync(allowed=1):
            float(y), float(y)


@torch.library.custom_op("traffic_test::scale_cast", mutates_args=())
def _scale_cast(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = (x.float() * s).to(torch.float8_e4m3fn)            # several aten ops inside: not seen
    return y, y.t().contiguous()


@_scale_cast.register_fake
def _(x, s):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(x.shape[::-1], dtype=torch.float8_e4m3fn)


def test_custom_op_default_and_custom_cost():
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    s = torch.tensor(2.0)
    r = count_traffic(lambda: torch.ops.traffic_test.scale_cast(x, s))
    c = r.ops["traffic_test.scale_cast.default"]
    assert c.kind == "custom" and (c.calls, c.launches) == (1, 1)
    assert (c.bytes_read, c.bytes_written) == (1024 + 4, 512 + 512)
    assert r.launches == 1 and len(r.ops) == 1            # its insides are not charged

    def cost(op, args, kwargs, out):
        if op is torch.ops.traffic_test.scale_cast.default:
            return 2, args[0].numel() * 2 * 2, sum(o.numel() for o in out)
        return None
    r = count_traffic(lambda: torch.ops.traffic_test.scale_cast(x, s) and x * 2, custom_cost=cost)
    assert r.ops["traffic_test.scale_cast.default"].launches == 2
    assert r.launches == 3 and r.bytes_read == 2048 + 1024 and r.bytes_written == 1024 + 1024


def test_a_layer_step_is_measured():
    from experiments.traffic import layer_step
    rep, e = layer_step("torch", "fp8_tensorwise", 32, torch.bfloat16, torch.float32, check=False)
    assert rep.gemm_launches == 3 and "aten._scaled_mm.default" in rep.ops
    assert rep.host_syncs == [] and e == 32 * 32
    assert rep.ops["lowprec.fp8_cast.default"].calls == 3 and rep.launches <= 12   # the fast path
    emulated, _ = layer_step("emulated", "fp8_tensorwise", 32, torch.bfloat16, torch.float32, check=False)
    assert emulated.launches > 50 and emulated.gemm_launches == 3
