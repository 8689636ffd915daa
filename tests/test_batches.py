"""gaexp/data/batches.py: the model's input from uint8 images (ToTensor, Normalize), crop_flip as torchvision does it,
and the stream's augmentation paired across regimes."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.functional as TF
from torchvision.transforms import Normalize, ToTensor

from gaexp.data.batches import PAD, Draw, Split, crop_flip, holdout_split, micro_batches

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def colour_images(n: int = 40, h: int = 12, w: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, h, w), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_inputs_are_to_tensor_then_normalize_channels_last():
    images = colour_images()
    split = Split(images, torch.zeros(40, dtype=torch.long), MEAN, STD)
    x = split.inputs(slice(0, 5))
    expected = torch.stack([Normalize(MEAN, STD)(ToTensor()(img.permute(1, 2, 0).numpy())) for img in images[:5]])
    assert x.shape == (5, 3, 12, 10) and x.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)  # one rounding of a subtraction and a division
    grey = Split(images[:, :1], torch.zeros(40, dtype=torch.long))
    assert torch.equal(grey.inputs(slice(0, 5)), images[:5, :1].float() / 255)  # no mean: exactly ToTensor's


def test_crop_flip_is_torchvisions_pad_crop_and_flip_exactly():
    images = colour_images(n=6)
    shift = torch.tensor([[0, 0], [8, 8], [3, 5], [8, 0], [1, 7], [4, 4]])
    flip = torch.tensor([False, True, True, False, True, False])
    out = crop_flip(images, shift, flip)
    for img, (top, left), f, got in zip(images, shift.tolist(), flip.tolist(), out):
        expected = TF.crop(TF.pad(img, [PAD]), top, left, 12, 10)  # RandomCrop(size, padding=4) at (top, left)
        expected = TF.hflip(expected) if f else expected
        assert torch.equal(got, expected)
    assert out.dtype == torch.uint8 and (out[0, :, :PAD, :] == 0).all()  # shift (0, 0): the padding's zeros show


@pytest.mark.parametrize("augment", ["none", "crop_flip"])
def test_the_nth_sample_is_the_same_image_cropped_and_flipped_the_same_in_every_regime(augment):
    """For a seed, the stream's samples, flattened, are one sequence whatever b (and k, which only groups the
    micro-batches into steps), across epoch boundaries (40 samples: 100 drawn cross two)."""
    split = Split(colour_images(), torch.arange(40), MEAN, STD, augment)
    drawn = {}
    for b in (1, 4, 16, 5):
        stream = micro_batches(len(split), b, seed=3, augment=augment)
        draws = [next(stream) for _ in range(80 // b)]
        whole = Draw.cat(draws)
        drawn[b] = (whole.index, split.inputs(whole.index, whole),
                    torch.cat([split.inputs(d.index, d) for d in draws]))  # micro-batch by micro-batch, as the loop
    index, inputs, looped = drawn[16]
    assert len(set(index[:40].tolist())) == 40 and torch.equal(looped, inputs)
    for b in (1, 4, 5):
        assert torch.equal(drawn[b][0], index) and torch.equal(drawn[b][1], inputs) and torch.equal(drawn[b][2], inputs)
    other = Draw.cat([next(micro_batches(len(split), 80, seed=4, augment=augment))])
    assert not torch.equal(other.index, index)  # another seed, another order
    if augment == "crop_flip":
        whole = Draw.cat([next(micro_batches(len(split), 80, seed=3, augment=augment))])
        assert 0.3 < whole.flip.float().mean() < 0.7 and whole.shift.min() == 0 and whole.shift.max() == 2 * PAD
        assert not torch.equal(split.inputs(index), inputs)  # augmented: not the plain images


def test_augmentation_leaves_the_data_order_as_it_was():
    """The crops and flips come from a generator of their own: turning them on changes no index of the stream
    (so a seed's images per step are those of augment=none, and of runs recorded before augmentation existed)."""
    plain = [next(s) for s in [micro_batches(40, 7, seed=2)] for _ in range(20)]
    augmented = [next(s) for s in [micro_batches(40, 7, seed=2, augment="crop_flip")] for _ in range(20)]
    assert all(torch.equal(p.index, a.index) and p.shift is None and a.shift is not None
               for p, a in zip(plain, augmented))


def test_held_out_images_are_never_augmented():
    split = Split(colour_images(), torch.arange(40), MEAN, STD, "crop_flip")
    kept, held = holdout_split(split, 8)
    assert (kept.augment, held.augment) == ("crop_flip", "none") and held.mean == MEAN
    assert len(kept) == 32 and not set(kept.labels.tolist()) & set(held.labels.tolist())
