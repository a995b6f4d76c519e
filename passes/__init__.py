"""Graph passes over torch.fx GraphModules, installed as ``odeify.passes``.

Each pass declares what kind it is, what it requires, forbids, ensures and invalidates
(``contract.analysis``, ``contract.module_record`` or ``contract.transformation``; the properties
are the constants of ``properties``), runs through the contract's one checker and returns a
``contract.PassResult``. The pipelines of ``odeify.compiler.pipelines`` run them in order:

* the graph's creation and shapes: ``tracing.trace``, ``tracing.annotate_shapes``;
* analyses (read-only): ``residual_blocks.find_blocks``, ``runs.group_runs``;
* transformations: ``fold_bn.fold_batchnorm``, ``lift.lift_runs``, ``head.mark_head``,
  ``manifest.set_manifestation``, ``lower.lower_stages`` / ``lower.raise_stages``,
  ``segments.checkpoint_segments`` / ``segments.inline_segments``.

The other modules are the passes' own support: ``contract`` and ``properties`` (the declarations),
``graph_utils`` (the small helpers passes share), ``periods`` (the period search ``runs`` calls) and
``glue`` (the layout glue of a period that ``lift`` reads).
"""
