"""JPEGs with restart markers (hpclb/data/_jpeg_region.c, hpclb.data.transforms.
add_restart_markers, ``hpclb data shards --restart-markers``): the transcode keeps every pixel,
the region decoder enters such a file at a crop's MCUs and gives exactly the whole-image
decode's pixels there, and a damaged or truncated one is refused as before."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from helpers import noisy_jpeg

from hpclb.data import transforms
from hpclb.data.transforms import add_restart_markers, decode_eval, decode_train

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def lib():
    """hpclb's region decoder and simplejpeg (the reference decode), or skip."""
    if transforms._jpeg_region() is None:
        pytest.skip("hpclb.data._jpeg_region was not built: apt-get install gcc libjpeg-dev, "
                    "then pip install -e . (setup.py)")
    if transforms._simplejpeg() is None:
        pytest.skip("simplejpeg (the jpeg extra) is not installed: pip install 'hpclb[jpeg]'")
    return transforms._jpeg_region()


def _fixture(name: str) -> bytes:
    from conftest import REPO
    return (REPO / "tests" / "images" / name).read_bytes()


CASES = {  # name: the original JPEG (made when asked); MCU width in pixels
    "4:2:0": (lambda: noisy_jpeg(640, 480), 16),
    "4:2:0 odd size": (lambda: noisy_jpeg(517, 389, seed=1), 16),
    "4:4:4": (lambda: noisy_jpeg(501, 377, seed=2, subsampling=0), 8),
    "4:2:2": (lambda: noisy_jpeg(333, 251, seed=3, subsampling=1), 16),
    "progressive": (lambda: noisy_jpeg(480, 360, seed=4, progressive=True), 16),
    "grey": (lambda: noisy_jpeg(350, 263, seed=5, mode="L"), 8),
    "a row of MCUs": (lambda: noisy_jpeg(700, 16, seed=6), 16),
    "4:1:1": (lambda: _fixture("sampling-4x1.jpg"), 32),
    "4:4:0": (lambda: _fixture("sampling-1x2.jpg"), 8),
    "4x2": (lambda: _fixture("sampling-4x2.jpg"), 32),
    "2x4": (lambda: _fixture("sampling-2x4.jpg"), 16),
}


def _whole(lib, data: bytes, scale: int) -> np.ndarray:
    """The whole image at ``1/scale``, uint8 (h, w, 3): simplejpeg's decode where it reads the
    file, else the region decoder's decode of it (4x2, 2x4: simplejpeg refuses them;
    tests/test_transforms.py checks the decode of the original files against PIL's)."""
    import simplejpeg

    width, height = lib.image_size(data)
    dw, dh = -(-width // scale), -(-height // scale)
    try:
        return simplejpeg.decode_jpeg(data, "RGB", fastdct=False, fastupsample=False,
                                      min_width=dw, min_height=dh)
    except ValueError:
        return np.frombuffer(lib.decode_region(data, scale, (0, 0, dw, dh)),
                             np.uint8).reshape(dh, dw, 3)


def _boxes(rng, dw: int, dh: int, n: int) -> list[tuple[int, int, int, int]]:
    """``n`` random boxes (many small ones: their edges fall anywhere in an MCU) and the boxes
    at every edge and corner, of one pixel and of the whole image."""
    boxes = [(0, 0, dw, dh), (0, 0, 1, 1), (dw - 1, dh - 1, dw, dh), (0, dh - 1, dw, dh),
             (dw - 1, 0, dw, dh), (dw // 2, dh // 2, dw // 2 + 1, dh // 2 + 1)]
    for k in range(n):
        w = int(rng.integers(1, dw + 1)) if k % 2 else int(rng.integers(1, min(dw, 40) + 1))
        h = int(rng.integers(1, dh + 1)) if k % 2 else int(rng.integers(1, min(dh, 40) + 1))
        x0, y0 = int(rng.integers(0, dw - w + 1)), int(rng.integers(0, dh - h + 1))
        boxes.append((x0, y0, x0 + w, y0 + h))
    return boxes


@pytest.mark.parametrize("case", list(CASES))
def test_restart_markers_keep_every_pixel_and_a_crop_reads_the_whole_decodes(lib, case):
    """add_restart_markers' copy decodes to the original's pixels (whole, at scales 1-8), holds
    a marker after every MCU (the region decoder enters it at a box's MCUs: restart_interval 1;
    the original: 0), and every box of it (random, at every edge, of one pixel) read by the
    region decoder is that box of the original's whole-image decode at that scale; so are the
    train and eval transforms' samples."""
    make, mcu_width = CASES[case]
    data = make()
    marked = add_restart_markers(data)
    assert lib.image_size(marked) == lib.image_size(data)
    assert lib.restart_interval(data) == 0 and lib.restart_interval(marked) == 1
    rng = np.random.default_rng(len(case))
    for s in (1, 2, 4, 8):
        whole = _whole(lib, data, s)
        assert _whole(lib, marked, s).tobytes() == whole.tobytes(), (case, s)
        dh, dw = whole.shape[:2]
        for x0, y0, x1, y1 in _boxes(rng, dw, dh, 120):
            got = lib.decode_region(marked, s, (x0, y0, x1, y1))
            assert bytes(got) == whole[y0:y1, x0:x1].tobytes(), (case, s, (x0, y0, x1, y1))
    reference = "simplejpeg" if case not in ("4x2", "2x4") else "libjpeg"
    for index in range(12):
        a = decode_train(io.BytesIO(marked), 32, 3, 1, index, decoder="libjpeg")
        b = decode_train(io.BytesIO(data), 32, 3, 1, index, decoder=reference)
        assert torch.equal(a, b), (case, index)
    assert torch.equal(decode_eval(io.BytesIO(marked), 32, 40, decoder="libjpeg"),
                       decode_eval(io.BytesIO(data), 32, 40, decoder=reference))


def test_every_restart_interval_that_divides_a_row_is_entered_at_the_box(lib):
    """A marker every 2, 4 or 8 MCUs, or every row of MCUs (PIL's restart_marker_rows, as
    some cameras write): entered at the box's segments, the same pixels; an interval that
    does not divide a row (3 MCUs of 40 per row) is decoded the general way, the same pixels."""
    data = noisy_jpeg(640, 200, seed=9)  # 40 MCUs per row
    rng = np.random.default_rng(0)
    rows = noisy_jpeg(640, 200, seed=9, restart_marker_rows=1)
    for marked, interval in [(lib.add_restart_markers(data, k), k) for k in (2, 4, 8, 3)] + \
            [(rows, 40)]:
        assert lib.restart_interval(marked) == (0 if interval == 3 else interval)
        for s in (1, 2):
            whole = _whole(lib, data if interval != 40 else rows, s)
            dh, dw = whole.shape[:2]
            for x0, y0, x1, y1 in _boxes(rng, dw, dh, 40):
                assert bytes(lib.decode_region(marked, s, (x0, y0, x1, y1))) == \
                    whole[y0:y1, x0:x1].tobytes(), (interval, s, (x0, y0, x1, y1))
    with pytest.raises(ValueError, match="interval 0: must be 1 to 65535"):
        lib.add_restart_markers(data, 0)


def _segments(data: bytes) -> list[int]:
    """Offsets of the restart markers (0xFF 0xD0-0xD7) in ``data``'s entropy-coded data."""
    return [i for i in range(len(data) - 1)
            if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7]


def test_a_crop_is_decoded_from_its_own_mcus(lib):
    """The region decoder reads only the box's MCUs (and a margin of two chroma samples): with
    the bytes of the first rows of MCUs garbled, a box in the image's lower half still gets
    exactly the original's pixels (the general way, which Huffman-decodes every row above the
    box, refuses the garbled original or gives other pixels), while a box that reaches the garbled rows is refused."""
    data = noisy_jpeg(320, 320, seed=11)  # 20 x 20 MCUs of 4:2:0
    marked = add_restart_markers(data)
    markers = _segments(marked)
    assert len(markers) == 20 * 20 - 1
    garbled = bytearray(marked)
    for i in range(markers[0] - 20, markers[3 * 20]):  # rows 0-2, but for their markers
        if i not in markers and i - 1 not in markers and garbled[i] != 0xFF \
                and garbled[i - 1] != 0xFF:
            garbled[i] = (garbled[i] * 7 + 13) % 255  # never 0xFF: no new marker
    garbled = bytes(garbled)
    whole = _whole(lib, data, 1)
    box = (40, 160, 200, 300)
    assert bytes(lib.decode_region(garbled, 1, box)) == whole[160:300, 40:200].tobytes()
    unmarked = bytearray(data)
    unmarked[len(data) // 20] ^= 0x55
    try:  # the general way reads the damage: refused, or other pixels where libjpeg missed it
        assert bytes(lib.decode_region(bytes(unmarked), 1, box)) != \
            whole[160:300, 40:200].tobytes()
    except ValueError:
        pass
    with pytest.raises(ValueError, match="JPEG: "):
        lib.decode_region(garbled, 1, (0, 0, 320, 320))


def test_a_damaged_or_truncated_file_with_restart_markers_is_refused(lib):
    """A restart-marked file cut short (in its first segments, its last, or only its end
    marker), or with a marker
    misnumbered, is not entered at the box: decoded the general way, it is refused for every
    train crop (ValueError: the sample then goes to PIL, which rejects it, naming the file); and
    random byte damage never crashes or hangs the decoder: it raises ValueError or decodes."""
    marked = add_restart_markers(noisy_jpeg(480, 360, seed=12))
    markers = _segments(marked)
    misnumbered = bytearray(marked)
    misnumbered[markers[100] + 1] ^= 0x01
    for bad in (marked[:len(marked) // 2], marked[:len(marked) * 99 // 100], marked[:-2],
                bytes(misnumbered)):
        assert lib.restart_interval(bad) == 0
        for index in range(12):
            def plan(width, height, index=index):  # decode_train's: a 64 x 64 train crop
                box, _ = transforms.train_crop(width, height, 0, 0, index)
                return -(-width * 64 // box[2]), -(-height * 64 // box[3]), box, None
            with pytest.raises(ValueError, match="JPEG: "):
                transforms._decode_libjpeg(bad, plan)
    rng = np.random.default_rng(1)
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(600):
        damaged = bytearray(marked)
        for i in rng.integers(0, len(damaged), int(rng.integers(1, 6))):
            damaged[int(i)] = int(rng.integers(0, 256))
        scale = int(rng.choice([1, 2, 4, 8]))
        x0, y0 = int(rng.integers(0, 480 // scale - 8)), int(rng.integers(0, 360 // scale - 6))
        try:
            lib.decode_region(bytes(damaged), scale, (x0, y0, x0 + 8, y0 + 6))
            outcomes["decoded"] += 1
        except ValueError:
            outcomes["refused"] += 1
    assert outcomes["decoded"] > 0 and outcomes["refused"] > 0, outcomes


def test_add_restart_markers_keeps_the_metadata_and_refuses_what_it_cannot_copy(lib):
    """The EXIF, ICC profile and comment segments are kept (PIL reads them back); a CMYK JPEG,
    a truncated one and a PNG raise ValueError (hpclb data shards then stores them as they
    are); the copy of a progressive file is sequential, and the benchmark's kind of file grows by at most 1 %."""
    from PIL import Image

    im = Image.open(io.BytesIO(noisy_jpeg(200, 150, seed=13)))
    exif = Image.Exif()
    exif[0x010E] = "a description"
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, exif=exif, icc_profile=b"not a real profile" * 10,
            comment=b"hpclb test")
    marked = add_restart_markers(buf.getvalue())
    with Image.open(io.BytesIO(marked)) as back:
        assert back.getexif()[0x010E] == "a description"
        assert back.info["icc_profile"] == b"not a real profile" * 10
        assert back.info["comment"] == b"hpclb test"
    progressive = noisy_jpeg(480, 360, seed=4, progressive=True)
    assert b"\xff\xc2" in progressive[:2000]
    assert b"\xff\xc2" not in add_restart_markers(progressive)[:2000]
    noisy = noisy_jpeg(640, 480, seed=14)
    assert len(add_restart_markers(noisy)) <= 1.01 * len(noisy)
    png = io.BytesIO()
    im.save(png, "PNG")
    for bad in (noisy_jpeg(100, 80, mode="CMYK"), noisy[:len(noisy) // 2], png.getvalue()):
        with pytest.raises(ValueError):
            add_restart_markers(bad)


def test_add_restart_markers_says_how_to_build_the_region_decoder(monkeypatch, tmp_path,
                                                                  capsys):
    """Where the region decoder was not built, add_restart_markers and write_shards(...,
    restart_markers=True) raise MissingExtraError naming the packages to install and what to
    do without them; ``hpclb data shards --restart-markers`` says so in one line, exits 1 (a
    missing extra, as every command) and writes nothing."""
    import sys

    from hpclb import cli
    from hpclb.data.shard_writer import write_shards
    from hpclb.errors import MissingExtraError

    src = tmp_path / "train"
    (src / "a").mkdir(parents=True)
    (src / "a" / "0.jpg").write_bytes(noisy_jpeg(40, 30))
    monkeypatch.setitem(sys.modules, "hpclb.data._jpeg_region", None)
    transforms._jpeg_region.cache_clear()
    try:
        with pytest.raises(MissingExtraError, match="^add_restart_markers needs .*apt-get "
                           "install gcc libjpeg-dev.*; or keep the file as it is$"):
            add_restart_markers(b"\xff\xd8\xff")
        with pytest.raises(MissingExtraError, match="apt-get install gcc libjpeg-dev"):
            write_shards("no-such-folder", "no-such-out", restart_markers=True)
        capsys.readouterr()
        assert cli.main(["data", "shards", str(src), str(tmp_path / "out"),
                         "--restart-markers"]) == 1
        err = capsys.readouterr().err
        assert "restart markers (hpclb data shards --restart-markers) needs hpclb's region " \
            "decoder" in err and "apt-get install gcc libjpeg-dev" in err and \
            err.rstrip().endswith("or pack without them") and "decoder='simplejpeg'" not in err
        assert not (tmp_path / "out").exists()
    finally:
        monkeypatch.undo()
        transforms._jpeg_region.cache_clear()


def test_shards_with_restart_markers_read_the_folders_samples(lib, tmp_path, capsys):
    """``hpclb data shards --restart-markers``: the JPEGs are stored with a marker after every
    MCU (a PNG and a CMYK JPEG unchanged), the index and the command count them, and every
    train and eval sample read from the shards is the folder's, bit for bit."""
    from PIL import Image

    from hpclb import cli
    from hpclb.data.images import ImageFolder
    from hpclb.data.shards import TarShards, read_index

    src = tmp_path / "train"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
    (src / "a" / "0.jpg").write_bytes(noisy_jpeg(517, 389, seed=1))
    (src / "a" / "1.jpg").write_bytes(noisy_jpeg(300, 260, seed=2, subsampling=0))
    png = _png_bytes()
    (src / "b" / "2.png").write_bytes(png)
    cmyk = io.BytesIO()
    Image.new("CMYK", (64, 48), (10, 200, 30, 5)).save(cmyk, "JPEG", quality=90)
    (src / "b" / "3.jpg").write_bytes(cmyk.getvalue())
    out = tmp_path / "shards"
    assert cli.main(["data", "shards", str(src), str(out), "--samples-per-shard", "3",
                     "--restart-markers"]) == 0
    assert "4 images of 2 classes in 2 shards; 2 JPEGs with restart markers" in \
        capsys.readouterr().out
    index = read_index(out)
    assert index["restart_markers"] == 2
    stored = [(out / index["shards"][s]).read_bytes()[o:o + n]
              for s, o, n in zip(index["shard"], index["offset"], index["size"])]
    assert [lib.restart_interval(d) for d in stored[:2]] == [1, 1]
    assert stored[2] == png and stored[3] == cmyk.getvalue()  # kept as they were
    for augment in (True, False):
        folder = ImageFolder(src, 32, 40, augment=augment, seed=4)
        tars = TarShards(out, 32, 40, augment=augment, seed=4)
        for epoch in (0, 1, 2):
            for i in range(4):
                assert torch.equal(tars.sample(i, epoch)[0], folder.sample(i, epoch)[0]), \
                    (augment, epoch, i)


def _png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 40, 3), np.uint8)).save(
        buf, "PNG")
    return buf.getvalue()


def test_every_column_and_row_at_every_scale_is_the_whole_images(lib):
    """Each one-pixel column and row of a restart-marked file, at every DCT scale, is that
    column or row of the whole image: at 1/2 and 1/4 libjpeg-turbo scales chroma up by its IDCT
    where the sampling allows (4:2:0) and upsamples it where not (4:2:2: a chroma sample is then
    2 pixels wide), so the margin must be whole chroma samples at the scale, and a rectangle
    too narrow for fancy upsampling (2 chroma samples) would be decoded differently."""
    files = [noisy_jpeg(w, h, seed=w, subsampling=sub) for w, h in ((250, 32), (37, 16), (70, 40))
             for sub in (1, 2)] + [_fixture(f"sampling-{n}.jpg") for n in ("4x1", "1x2")]
    for data in files:
        marked = add_restart_markers(data)
        for s in (1, 2, 4, 8):
            whole = _whole(lib, data, s)
            dh, dw = whole.shape[:2]
            boxes = [(x, 0, x + 1, dh) for x in range(dw)] + [(0, y, dw, y + 1) for y in range(dh)]
            for x0, y0, x1, y1 in boxes:
                assert bytes(lib.decode_region(marked, s, (x0, y0, x1, y1))) == \
                    whole[y0:y1, x0:x1].tobytes(), (lib.image_size(data), s, (x0, y0, x1, y1))
