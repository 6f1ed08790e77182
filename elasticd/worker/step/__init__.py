"""One step: the vote and its verdict, the gradient reducer that carries them, the per-step
protocol, stepping the optimizers, the records of what was applied and confirmed, and the test-only
fault seam."""
