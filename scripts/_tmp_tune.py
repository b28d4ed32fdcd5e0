import sys, time
sys.path.insert(0, "src")
import numpy as np, torch
from torch import nn
from dlenv.data.demo import CLASSES, render
torch.set_num_threads(int(sys.argv[1]))
def run(size, n, nv, epochs, width, aug):
    torch.manual_seed(0)
    def data(split, n):
        x = [render(c, np.random.default_rng([0, split, ci, i]), size) for ci, c in enumerate(CLASSES) for i in range(n)]
        y = [ci for ci in range(len(CLASSES)) for _ in range(n)]
        return torch.from_numpy(np.stack(x)).permute(0, 3, 1, 2).float().div(255).sub(0.5).div(0.25), torch.tensor(y)
    xt, yt = data(0, n); xv, yv = data(1, nv)
    def block(i, o): return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2))
    model = nn.Sequential(block(3, width), block(width, 2*width), block(2*width, 4*width), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4*width, 10))
    t=time.time()
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=epochs * (len(xt) // 32))
    for _ in range(epochs):
        model.train(); perm = torch.randperm(len(xt))
        for s in range(len(xt) // 32):
            idx = perm[s*32:(s+1)*32]; x = xt[idx]
            if aug: x = torch.where(torch.rand(len(x),1,1,1) < 0.5, x.flip(3), x)
            loss = nn.functional.cross_entropy(model(x), yt[idx]); opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    model.eval()
    with torch.no_grad(): acc = (model(xv).argmax(1) == yv).float().mean().item()
    print(f"size {size} n {n} epochs {epochs} width {width} aug {aug}: acc {acc:.3f} in {time.time()-t:.1f}s", flush=True)
for cfg in [(32,60,20,25,16,1),(32,100,20,20,16,1),(32,60,20,40,16,1),(32,100,20,30,32,1),(32,200,20,15,16,1)]:
    run(*cfg)
