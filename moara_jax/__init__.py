"""moara_jax: MoARa (module-aware rank allocation + block-wise magnitude--direction
decomposition) for GaLore-family low-rank training, as composable Optax transforms.

The chain for one target matrix is ``decompose -> project -> inner_adam -> recompose``
(:func:`scale_by_moara`); :func:`moara_adamw` partitions a model's parameters by module type.

Code map (the paper's Algorithm 1 and Section 3 -> where it is):

==========================================================  ==========================================
Phase 1, profiling: log ``G_t(W)``, ``G_recon,t(W)``          ``train.profile`` (``mode: profile``)
Eq. (module_alignment) ``S(W, t) = cos(G, G_recon)``         ``_alignment.matrix_alignment``,
                                                              ``_decomposition.alignment``
Phase 2, ``S_tau`` per module type                           ``_alignment.module_alignment``
Phase 3, ``r_tau = r_base -/+ delta r`` (donors, receivers)  ``_allocation.allocate_ranks``
the training step, per target weight                         ``_chain.scale_by_moara`` (the chain)
``M, V <- Decompose(G, B)`` (Sec. 3.1, blocks of ``B``)       ``_chain.decompose`` ->
                                                              ``_decomposition.decompose_along``
``P_tau <- TruncatedSVD(V, r_tau)`` every ``T_SVD`` steps      ``_projection.project``
                                                              (``refresh_bases``; ``_bases``: SVD,
                                                              eigh, randomized + CholeskyQR2)
``V~ <- P^T V``                                               ``_projection.project_value``
``dV~ <- Optimizer_V``, ``dM <- Optimizer_M``                 ``_adam.inner_adam`` (one Adam per part)
``dV <- P dV~``; ``W <- W - eta (Rep_B(dM) * dV)``             ``_chain.recompose``
                                                              (``_decomposition.recompose_along``),
                                                              then ``moara_adamw``'s learning rate
another host's projection and Adam (the cross-method study)  ``hosts/`` (one module per host)
the stages' hyperparameters (one definition, defaults)       ``hosts._base.StageOptions``, built once
                                                              by each public entry, passed to the host
state memory (the paper's "Opt. state")                      ``_accounting.state_bytes``
a kernel whose matrix spans several axes (head-split         ``_matrices.as_matrices``
attention ``(embed, heads, head_dim)``)                       (``MatrixAxes``)
the state placed as the parameters; Explicit mesh axes        ``_sharding.follow_params``
                                                              (``state_shardings``)
==========================================================  ==========================================
"""

from moara_jax._accounting import state_bytes
from moara_jax._adam import (
    DecayAfterStepState,
    InnerAdamState,
    adamw,
    decay_after_step,
    inner_adam,
    pytorch_adam,
    torch_adam_direction,
)
from moara_jax._alignment import (
    matrix_alignment,
    module_alignment,
    projection_bases,
    reconstruct,
)
from moara_jax._allocation import (
    DEFAULT_DONORS,
    DEFAULT_RECEIVERS,
    MLA_DONORS,
    allocate_ranks,
    default_donors,
    rank_table,
    resolve_module_ranks,
)
from moara_jax._chain import (
    decompose,
    host_stages,
    recompose,
    scale_by_fira,
    scale_by_galore,
    scale_by_moara,
    stage_chain,
)
from moara_jax._decomposition import alignment, block_decompose, block_recompose, num_blocks
from moara_jax._labels import (
    LLAMA_MODULE_TYPES,
    MLA_MODULE_TYPES,
    MODULE_TYPES,
    label_tree,
    module_label,
    path_names,
)
from moara_jax._matrices import MatrixAxes, as_matrices, matrix_view
from moara_jax._nodes import Decomposed, LowRank
from moara_jax._optimizer import MOARA_ADAMW_STATIC_ARGS, moara_adamw
from moara_jax._projection import ProjectState, project, projection_side
from moara_jax._quant import Blockwise8bit, adam8bit, dynamic_map
from moara_jax._sharding import state_shardings
from moara_jax.hosts import (
    HOSTS,
    OSD,
    Fira,
    GaLore,
    Host,
    LDAdam,
    QGaLore,
    StageOptions,
    SubTrackPP,
    register_host,
    resolve_host,
)
from moara_jax.hosts.fira import FiraState, fira_adam
from moara_jax.hosts.ldadam import LDAdamState, ldadam, ldadam_side
from moara_jax.hosts.osd import OSDProjectState, osd_project, pca_loss
from moara_jax.hosts.q_galore import (
    QGaLoreProjectState,
    QuantizedBasis,
    QuantizeWeightsState,
    q_galore_project,
    quantize_weights,
)
from moara_jax.hosts.subtrack_pp import (
    SubTrackProjectState,
    geodesic_step,
    subtrack_project,
    transport_moments,
)

__all__ = [
    "DEFAULT_DONORS",
    "DEFAULT_RECEIVERS",
    "HOSTS",
    "LLAMA_MODULE_TYPES",
    "MLA_DONORS",
    "MLA_MODULE_TYPES",
    "MOARA_ADAMW_STATIC_ARGS",
    "MODULE_TYPES",
    "OSD",
    "Blockwise8bit",
    "DecayAfterStepState",
    "Decomposed",
    "Fira",
    "FiraState",
    "GaLore",
    "Host",
    "InnerAdamState",
    "LDAdam",
    "LDAdamState",
    "LowRank",
    "MatrixAxes",
    "OSDProjectState",
    "ProjectState",
    "QGaLore",
    "QGaLoreProjectState",
    "QuantizeWeightsState",
    "QuantizedBasis",
    "StageOptions",
    "SubTrackPP",
    "SubTrackProjectState",
    "adam8bit",
    "adamw",
    "alignment",
    "allocate_ranks",
    "as_matrices",
    "block_decompose",
    "block_recompose",
    "decay_after_step",
    "decompose",
    "default_donors",
    "dynamic_map",
    "fira_adam",
    "geodesic_step",
    "host_stages",
    "inner_adam",
    "label_tree",
    "ldadam",
    "ldadam_side",
    "matrix_alignment",
    "matrix_view",
    "moara_adamw",
    "module_alignment",
    "module_label",
    "num_blocks",
    "osd_project",
    "path_names",
    "pca_loss",
    "project",
    "projection_bases",
    "projection_side",
    "pytorch_adam",
    "q_galore_project",
    "quantize_weights",
    "rank_table",
    "recompose",
    "reconstruct",
    "register_host",
    "resolve_host",
    "resolve_module_ranks",
    "scale_by_fira",
    "scale_by_galore",
    "scale_by_moara",
    "stage_chain",
    "state_bytes",
    "state_shardings",
    "subtrack_project",
    "torch_adam_direction",
    "transport_moments",
]

__version__ = "0.1.0"
