"""The foundation every layer may import: the one config parser (`parse`: typed dataclasses from
YAML/dicts, unknown keys with did-you-mean, the path of every error, `ConfigError`) and the
string-enum helper.

May import: nothing from lowprec.
"""
