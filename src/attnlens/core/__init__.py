"""The shared pass and the engines that run it: the :class:`~.model_runner.ModelRunner` record they take, the batch
engine, the generation engine, the capture and what a method sees (batch state), and the encoding, padding, memory
and progress pieces they use."""
