"""Sites: the precision plan, the switchable `PrecisionLinear` and its autograd functions, the
backends, the weight cache, `prepare(model, plan) -> PrecisionState`.

May import: lowprec.numerics, lowprec.base.
"""
