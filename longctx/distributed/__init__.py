"""Many processes, one model: the parallel settings and device mesh, the sequence layouts of context
parallelism, and the context-parallel forms of the KDA and DSA layers. Built on torch.distributed
only (DeviceMesh, its autograd-aware functional collectives); see each module's docstring.

Under context parallelism every rank's loss is its share: summed over the cp ranks it is the
single-process loss, and the parameter gradients summed over the cp ranks are the single-process
gradients (the gradient reduction runs over dp x cp).
"""

from .dsa_cp import dsa_cp_bytes, dsa_cp_forward
from .kda_cp import MODES as KDA_CP_MODES
from .kda_cp import kda_chunk_state, kda_cp_bytes, kda_cp_forward, kda_hidden_gather, kda_qkv_a2a
from .mesh import (CPContext, ParallelConfig, build_mesh, cp_context, cp_group, cp_rank, cp_size, dp_group, dp_rank,
                   init_distributed)
from .zigzag import LAYOUTS, check_seq_len, positions, segments, shard, unshard

__all__ = [
    "CPContext", "KDA_CP_MODES", "LAYOUTS", "ParallelConfig", "build_mesh", "check_seq_len", "cp_context", "cp_group",
    "cp_rank", "cp_size", "dp_group", "dp_rank", "dsa_cp_bytes", "dsa_cp_forward", "init_distributed",
    "kda_chunk_state", "kda_cp_bytes", "kda_cp_forward", "kda_hidden_gather", "kda_qkv_a2a", "positions", "segments",
    "shard", "unshard",
]
