"""The Python API's parts (steer.Lab lives in steer/lab.py): vectors as objects, edits as calls, run outputs as
tables. Each part builds the config the CLI would get and runs it through steer.runs."""
