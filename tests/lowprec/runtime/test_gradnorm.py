"""The global gradient norm of `lowprec run`'s data-parallel engine (`gradnorm.clip_global`) on one
gloo rank: the reference GPT's tensor-parallel weights live on the (dp_replicate, dp_shard, tp)
mesh and its replicated parameters on the (dp_replicate, dp_shard) one, so the norm is taken per
mesh and combined, and the clip multiplies each mesh's gradients apart. Both must give what
`torch.nn.utils.clip_grad_norm_` gives on the same model in one process (the multi-rank runs:
tests/experiments/test_parallel_parity.py)."""

import torch

MODEL = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16)


def test_the_norm_over_two_meshes_is_one_process_s_and_clips_alike(one_rank):
    from experiments.model import build_gpt
    from lowprec.runtime.engines.fsdp import FullyShardedDP
    from lowprec.runtime.engines.mesh import build_mesh

    torch.manual_seed(0)
    model, ref = build_gpt(**MODEL), build_gpt(**MODEL)
    ref.load_state_dict(model.state_dict())
    mesh = build_mesh("cpu")
    model.tensor_parallel(mesh["tp"])   # tp 1: DTensors on the 3-D mesh, the rest plain
    engine = FullyShardedDP(model, mesh_or_group=mesh["dp_replicate", "dp_shard"])
    meshes = {tuple(p.device_mesh.mesh_dim_names) for p in engine.params}
    assert meshes == {("dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard", "tp")}, meshes

    x = torch.randint(0, MODEL["vocab_size"], (4, MODEL["block_size"]))
    y = torch.randint(0, MODEL["vocab_size"], (4, MODEL["block_size"]))
    engine.forward_backward(x, y)
    ref(x, y)[1].backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    got = engine.clip_grad_norm(0.1)
    assert type(got) is torch.Tensor and want > 0.1   # a plain tensor; the clip acts
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7), name
