from epifit.cli import run

run()
