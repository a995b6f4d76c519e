"""The intermediate representation: the settings a stage accepts, the analysis results (``plan``),
the one node-meta schema (``meta``) and the stage IR (``stage_ir``: a run of blocks as data).
Runs nothing: ``codegen`` writes its computation and ``runtime`` executes it."""
