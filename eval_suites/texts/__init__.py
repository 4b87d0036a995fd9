"""The texts of the eval suites that need no data folder, installed as the package data `lowprec.evals.texts`.

The suites and tasks that read them are lowprec.evals (lowprec/evals/); README.md here says
where each text comes from.
"""
