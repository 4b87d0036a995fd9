"""The foundation every layer may import: the one config parser (`parse`: typed dataclasses from
YAML/dicts, unknown keys with did-you-mean, the path of every error, `ConfigError`), the
string-enum helper, and one writer per file or folder (`writer_lock`: an OS lock that dies
with its holder).

May import: nothing from lowprec.
"""
