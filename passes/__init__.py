"""Graph passes over torch.fx GraphModules, installed as ``odeify.passes``.

Each pass declares a :class:`~odeify.passes.contract.PassSpec` (what it requires and ensures,
whether it modifies the graph and whether it preserves the computation) and runs through the
contract's one runner. In pipeline order:

* analyses (read-only): ``residual_blocks.find_blocks``, ``runs.group_runs``;
* transformations: ``fold_bn.fold_batchnorm``, ``lift.lift_runs``, ``lower.lower_stages`` /
  ``lower.raise_stages``, ``segments.checkpoint_segments`` / ``segments.inline_segments``.

Shape annotation (``odeify.passes.tracing.annotate_shapes``) is declared the same way and ensures the
``shapes`` property the analyses require. ``graph_utils`` holds the small helpers passes share.
"""
