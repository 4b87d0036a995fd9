"""The torchtitan job of the mixture-of-experts tests: titan_helpers' job module with torchtitan's
qwen3 MoE model in place of llama3's debug model.

The model is torchtitan 0.3's own Qwen3 MoE (`Qwen3Model`, its `_build_qwen3_moe_layers`,
`GroupedExperts` run by the `AllToAllTokenDispatcher` under expert parallelism, the MoE
load-balancing hook), at the size of its `debugmodel_moe` divided to fit a shared CPU: 2 layers,
dim 64, 4 heads of 16 (2 KV), 4 experts of width 32, top 2, registered as the flavor
`lowprec_tiny_moe` in the job process.
"""

from titan_helpers import JOB

MODEL = '''\
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm,
                                     model_registry, qwen3_configs)
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug
from torchtitan.models.qwen3.model import Qwen3Model


def _tiny_moe(attn_backend, moe_comm_backend="standard"):
    dim, head_dim, vocab = 64, 16, 512
    return Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim,
                                       moe_hidden_dim=32, num_experts=4, top_k=2, attn_backend=attn_backend,
                                       moe_comm_backend=moe_comm_backend,
                                       rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=256, theta=1000000.0)))


qwen3_configs["lowprec_tiny_moe"] = _tiny_moe


def _moe_and_faults(optimizers, model_parts, parallel_dims):
    register_moe_load_balancing_hook(optimizers, model_parts, parallel_dims)
    _faults(optimizers, model_parts, parallel_dims)
'''

# (old, new) edits of the llama3 job, each of which must find its text (a changed template fails here)
EDITS = [
    ("from torchtitan.models.llama3 import model_registry\n"
     "from torchtitan.models.llama3.config_registry import llama3_debugmodel\n", ""),
    ("SETTINGS = json.loads({settings!r})\n",
     "SETTINGS = json.loads({settings!r})\n" + MODEL.replace("{", "{{").replace("}", "}}")),
    ("    config = llama3_debugmodel()\n    config.model_spec = model_registry(\"debugmodel\", converters=[",
     "    config = qwen3_moe_debug()\n    config.model_spec = model_registry(\"lowprec_tiny_moe\", converters=["),
    ("post_optimizer_build_fn=_faults)", "post_optimizer_build_fn=_moe_and_faults)"),
    # under EP every forward is a collective (the all-to-alls): every rank validates the same number
    # of batches (torchtitan's default, the whole validation set, differs per rank and hangs)
    ("    config.validator.freq = 1000\n", "    config.validator.freq = 1000\n    config.validator.steps = 2\n"),
    # each rank's report also says how many tokens each expert site ran there in the last forward,
    # and the router metrics of the last logged step (what a tracker logs: every rank's tokens)
    ('"grad_norms": h.after.record.grad_norms}}',
     '"grad_norms": h.after.record.grad_norms, "expert_tokens": {{f: s.module.tokens for f, s in '
     'h.state.sites.items() if hasattr(s.module, "expert_index")}}, '
     '"routers": h.after.record.routers}}'),
]


def _edited(text: str) -> str:
    for old, new in EDITS:
        assert text.count(old) == 1, f"the llama3 job template changed: {old!r} is not in it once"
        text = text.replace(old, new)
    return text


MOE_JOB = _edited(JOB)
