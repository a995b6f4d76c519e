"""The intermediate representation: the settings a stage accepts, the analysis results (``plan``),
the one node-meta schema (``meta``), the stage IR (``stage_ir``: a run of blocks as data), and
what a converted model keeps of its source: the records of its folded BatchNorms (``fold_records``)
and the source's own tensors where they changed (``source_tensors``). Runs nothing: ``codegen``
writes its computation and ``runtime`` executes it."""
