"""Code generation: writes a stage's computation as readable fx graphs (unrolled, per step, per
field evaluation), from the IR alone."""
