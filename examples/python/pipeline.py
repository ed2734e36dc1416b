"""A model in two stages on two workers, fed micro-batches by a third, as PyTorch's
RPC pipeline tutorial builds it, with the import changed. The driver sends each
micro-batch to stage 1 with remote() (the activation stays there, behind an RRef),
and stage 2 fetches it through the RRef, so micro-batches overlap across stages.
Training goes backwards the same way by hand (ferry has no distributed autograd):
each stage keeps its micro-batches' activations and returns its input's gradient.

    ferry run --standalone --nproc-per-node 3 python3 examples/python/pipeline.py [STEPS] [MICRO_BATCHES]

Prints the first and last loss, and fails unless the loss went down.
"""

import os
import sys
import threading

import torch

import ferry.rpc as rpc  # was: import torch.distributed.rpc as rpc

IN, HIDDEN, OUT, BATCH = 8, 32, 1, 64


class Stage:
    """One stage: a module, the activations of the micro-batches in flight, an optimizer."""

    def __init__(self, module):
        self.module = module
        self.saved = {}
        self.lock = threading.Lock()
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.2)

    def forward(self, mb, x):
        if isinstance(x, rpc.RRef):
            x = x.to_here()
        x = x.detach().requires_grad_(True)
        y = self.module(x)
        with self.lock:
            self.saved[mb] = (x, y)
        return y.detach()

    def backward(self, mb, grad):
        with self.lock:
            x, y = self.saved.pop(mb)
        y.backward(grad)
        return x.grad

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()
        return True


def make_stage1():
    torch.manual_seed(1)
    return Stage(torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh()))


def make_stage2():
    torch.manual_seed(2)
    return Stage(torch.nn.Linear(HIDDEN, OUT))


def train(steps, micro_batches):
    s1 = rpc.remote("worker1", make_stage1)
    s2 = rpc.remote("worker2", make_stage2)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(IN, OUT, generator=gen) / IN**0.5
    losses = []
    for _ in range(steps):
        x = torch.randn(BATCH, IN, generator=gen)
        y = torch.tanh(x @ w)
        outs = []
        for mb, xb in enumerate(x.chunk(micro_batches)):
            h = s1.remote().forward(mb, xb)            # stays on worker1
            outs.append(s2.rpc_async().forward(mb, h))  # worker2 fetches it
        out = torch.cat([f.wait() for f in outs]).requires_grad_(True)
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        losses.append(loss.item())
        grads = out.grad.chunk(micro_batches)
        back = [s2.rpc_async().backward(mb, g).then(lambda f, mb=mb: s1.rpc_async().backward(mb, f.value()))
                for mb, g in enumerate(grads)]
        for f in back:
            f.wait().wait()
        s1.rpc_sync().step()
        s2.rpc_sync().step()
    return losses


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    micro_batches = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=60))
    rc = 0
    if rank == 0:
        losses = train(steps, micro_batches)
        print(f"pipeline: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f} after {steps} steps "
              f"of {micro_batches} micro-batches")
        if not losses[-1] < 0.5 * losses[0]:
            print("pipeline: the loss did not go down", file=sys.stderr)
            rc = 1
    rpc.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
