"""Exact numerics: weight paths over depth (bases, exact Fraction coefficients, fit matrices),
Butcher tableaus and reversible schemes (register programs) as data. Above ``core``; knows nothing
of graphs or stages."""
