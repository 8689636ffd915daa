"""The data in memory: a split as uint8 tensors with how its images become the model's input, the fixed
hold-out, and the stream of micro-batches (one generator per seed, whatever the regime; its augmentation
from a second one). Where the splits come from: gaexp/data/dataset.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from gaexp.config import HOLDOUT_SEED

PAD = 4  # crop_flip's zero padding on each side, as torchvision's RandomCrop(size, padding=4)
CROP_FLIP, VIEWS = "crop_flip", "views"  # augmentations: one crop and flip per image; two views, each its own


@dataclass(frozen=True)
class Split:
    """Images as the files give them and what the model sees of them: (x / 255 - mean) / std, channels_last,
    training images augmented by the stream (`augment`)."""

    images: torch.Tensor  # uint8 [N, C, H, W]
    labels: torch.Tensor  # int64 [N]
    mean: Optional[Sequence[float]] = None  # per channel, of the [0, 1] pixels; None: none (ToTensor's)
    std: Optional[Sequence[float]] = None
    augment: str = "none"  # none | crop_flip | views (a contrastive task's: two crop_flip views of each image, in
    # turn: the model's rows 2i and 2i + 1 are image i's): how the micro-batch stream draws this split's images
    dtype: torch.dtype = torch.float32  # the model's input: its weights' dtype (precision=bf16w: bf16)

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: torch.Tensor | slice) -> "Split":
        """These images, with the same preprocessing."""
        return replace(self, images=self.images[index], labels=self.labels[index])

    def inputs(self, index: torch.Tensor | slice, draw: Optional["Draw"] = None) -> torch.Tensor:
        """The model's float input for the images at `index` (a micro-batch's `Draw`: its crops and flips)."""
        images = self.images[index]
        if self.augment == VIEWS:
            images = images.repeat_interleave(2, dim=0)
        if draw is not None and draw.shift is not None:
            images = crop_flip(images, draw.shift.reshape(-1, 2), draw.flip.reshape(-1))
        x = images.float().div_(255)
        if self.mean is not None:
            stats = {"dtype": x.dtype, "device": x.device}
            x = x.sub_(torch.tensor(self.mean, **stats).view(1, -1, 1, 1)).div_(torch.tensor(self.std, **stats).view(1, -1, 1, 1))
        x = x.contiguous(memory_format=torch.channels_last)
        return x if self.dtype == torch.float32 else x.to(self.dtype)

    def batch(self, draw: "Draw") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of a micro-batch."""
        return self.inputs(draw.index, draw), self.labels[draw.index]

    def items(self, index: torch.Tensor) -> torch.Tensor:
        """What the samples at `index` hold to train on, as a tensor on their device: an image is one."""
        return torch.tensor(index.numel(), device=index.device)


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, C, H, W] (or [B, H, W], one channel) -> float in [0, 1], exactly as ToTensor, channels_last."""
    return Split(images if images.dim() == 4 else images.unsqueeze(1), torch.empty(0)).inputs(slice(None))




def holdout_indices(num: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices trained on, `size` held-out indices): the held-out ones are the first `size` of a fixed
    permutation (generator seed HOLDOUT_SEED, whatever the run's seed); both sorted."""
    order = torch.randperm(num, generator=torch.Generator().manual_seed(HOLDOUT_SEED))
    return order[size:].sort().values, order[:size].sort().values


def holdout_split(data: Split, size: int) -> tuple[Split, Split]:
    """(the images trained on, `size` held-out images never trained on and never augmented), in their original
    order."""
    kept, held = (i.to(data.labels.device) for i in holdout_indices(len(data.labels), size))
    return data.take(kept), replace(data.take(held), augment="none")


# --- the stream of micro-batches ----------------------------------------------------------------------

@dataclass(frozen=True)
class Draw:
    """One micro-batch: which training images, and (crop_flip) each one's crop offsets and flip (views: each of
    its two views')."""

    index: torch.Tensor  # int64 [B]
    shift: Optional[torch.Tensor] = None  # int64 [B, 2] (views: [B, 2, 2]): top and left of the crop in the padded
    # image, 0..2*PAD
    flip: Optional[torch.Tensor] = None  # bool [B] (views: [B, 2])

    @staticmethod
    def cat(draws: Sequence["Draw"]) -> "Draw":
        """The samples of several micro-batches, in order (a batched step's b*k)."""
        if draws[0].shift is None:
            return Draw(torch.cat([d.index for d in draws]))
        return Draw(*(torch.cat([getattr(d, f) for d in draws]) for f in ("index", "shift", "flip")))


def augment_seed(seed: int) -> int:
    """The augmentation generator's seed: a stream of its own, derived from the run's seed (never the data
    order's numbers reused)."""
    return int(np.random.SeedSequence([seed, 0xA06]).generate_state(1, np.uint64)[0] >> 1)


def counted(batches: Iterator[Draw], split: Split, tally: list) -> Iterator[Draw]:
    """`batches` as they come, each micro-batch's items (`split.items`) added to `tally[0]` on the device (no host
    synchronization): a language model's tokens, for its speed in tokens/s."""
    for draw in batches:
        tally[0] = tally[0] + split.items(draw.index)
        yield draw


def micro_batches(num_samples: int, batch_size: int, seed: int, augment: str = "none",
                  device: torch.device | str = "cpu") -> Iterator[Draw]:
    """Endless consecutive micro-batches of a stream of per-epoch permutations.

    The stream depends on `seed` alone (its own generator), so for a given seed
    optimizer step t sees the same samples whether they come as 1x16, 4x4 or
    16x1. A micro-batch that crosses an epoch boundary takes the rest of one
    permutation and the start of the next (identical to DataLoader(shuffle=True)
    whenever batch_size divides num_samples, as for every regime of the study).
    With augment=crop_flip each position of the stream also draws its crop and flip
    from a second generator, one epoch at a time: the n-th sample is the same image,
    cropped and flipped the same way, whatever the regime (views: two of each, one per view).
    """
    order = torch.Generator().manual_seed(seed)
    augmenting = augment in (CROP_FLIP, VIEWS)
    per = (2,) if augment == VIEWS else ()  # each image's draws: one, or one per view
    extra = torch.Generator().manual_seed(augment_seed(seed)) if augmenting else None
    empty = torch.empty(0, dtype=torch.long, device=device)
    stream, shifts, flips = empty, empty.view(0, *per, 2), empty.bool().view(0, *per)
    while True:
        if stream.numel() < batch_size:
            stream = torch.cat([stream, torch.randperm(num_samples, generator=order).to(device)])
            if augmenting:
                shifts = torch.cat([shifts, torch.randint(0, 2 * PAD + 1, (num_samples, *per, 2), generator=extra).to(device)])
                flips = torch.cat([flips, torch.randint(0, 2, (num_samples, *per), generator=extra).bool().to(device)])
        if augmenting:
            yield Draw(stream[:batch_size], shifts[:batch_size], flips[:batch_size])
            shifts, flips = shifts[batch_size:], flips[batch_size:]
        else:
            yield Draw(stream[:batch_size])
        stream = stream[batch_size:]


def micro_batch_indices(num_samples: int, batch_size: int, seed: int,
                        device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
    """The image indices of `micro_batches` (no augmentation)."""
    return (draw.index for draw in micro_batches(num_samples, batch_size, seed, device=device))


def crop_flip(images: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Each uint8 image [C, H, W] zero-padded by PAD, cropped back to H x W at its `shift` (top, left), and
    mirrored left-right where `flip`: torchvision's RandomCrop(padding=4) and RandomHorizontalFlip, exact."""
    n, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (PAD, PAD, PAD, PAD))
    rows = shift[:, :1] + torch.arange(h, device=images.device)  # [B, H]
    cols = shift[:, 1:] + torch.arange(w, device=images.device)  # [B, W]
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(n, device=images.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
