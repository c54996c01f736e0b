"""Tasks and rewards: the `Task` seam (rewards/task.py), the procedural task families, the long-tail
benchmark task, effort conditioning's prompt prefix and length penalty. Imports nothing of asyncrl's
but `configbase`."""

from rewards.task import CodeRunner, ExecResult, Message, Problem, Task, Trajectory, Turn, Verdict, VerifyContext

__all__ = ["CodeRunner", "ExecResult", "Message", "Problem", "Task", "Trajectory", "Turn", "Verdict", "VerifyContext"]
