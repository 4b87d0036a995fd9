"""The gate files that ship with lowprec, found by name (`lowprec gate --gates default`, `eval.gates: inloop`).

This folder is installed as the package data `lowprec.gates.files`; the code that reads these
files is lowprec.gates (lowprec/gates/). See docs/gates.md for the format.
"""
