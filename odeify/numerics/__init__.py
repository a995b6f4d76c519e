"""Exact numerics: weight paths over depth (bases, exact Fraction coefficients, fit matrices) and
Butcher tableaus as data. Above ``core``; knows nothing of graphs or stages."""
