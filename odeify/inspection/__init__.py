"""Looking at a converted model: tables and JSON of plans and stages, the code a model runs,
Graphviz output and plots."""
