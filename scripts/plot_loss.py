"""Plots train and val loss from a train_llama3cu log.txt to a PNG.

  python scripts/plot_loss.py runs/d6/log.txt runs/d6/loss.png
"""
import os
import sys


def read_log(path):
    """(train, val): lists of (step, loss) from the 'step N train_loss X' and 'step N val_loss X' lines."""
    train, val = [], []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[0] == "step" and parts[2] in ("train_loss", "val_loss"):
                (train if parts[2] == "train_loss" else val).append((int(parts[1]), float(parts[3])))
    return train, val


def main():
    if len(sys.argv) != 3:
        raise SystemExit("usage: plot_loss.py log.txt out.png")
    if not os.path.isfile(sys.argv[1]):
        raise SystemExit(f"error: no log file {sys.argv[1]}")
    train, val = read_log(sys.argv[1])
    if not train:
        raise SystemExit(f"error: no 'step N train_loss X' lines in {sys.argv[1]}")
    import matplotlib  # here, so that read_log can be imported (scripts/convergence.py) without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.figure(figsize=(8, 5))
    plt.plot(*zip(*train), label="train", alpha=0.8)
    if val:
        plt.plot(*zip(*val), "o-", label="val")
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.legend()
    plt.grid(alpha=0.3)
    plt.title(sys.argv[1])
    plt.savefig(sys.argv[2], dpi=100, bbox_inches="tight")
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
