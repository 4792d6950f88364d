"""The tasks (`task=`): one module each, with its checks, how its job is prepared and how it runs, registered once in
steer/tasks/registry.py, the one place that picks a task's module."""
