"""The eval suite definitions (suites.yaml), installed as package data of lowprec.evals."""
