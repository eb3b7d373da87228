/* hpclb.data._jpeg_region: decode one region of a JPEG at a DCT scale with libjpeg-turbo's
   libjpeg API (jpeg_crop_scanline, jpeg_skip_scanlines; libjpeg-turbo >= 1.5).

   The train transform's random-resized crop needs only the crop's pixels. Decoding the whole
   image and cutting the crop out of it (simplejpeg, PIL) inverse-transforms, upsamples and
   colour-converts every pixel; here the rows above the region and the columns beside it are
   only Huffman-decoded (a JPEG without restart markers cannot be entered mid-stream) and the
   rows below it are not read at all. The region's pixels are those of the whole-image decode
   at the same scale (accurate integer DCT, fancy upsampling: simplejpeg's fastdct=False,
   fastupsample=False; tests/test_transforms.py compares them): the decoded columns reach one
   pixel left of the region and 32 right of it, so the upsampling of its edge columns reads
   their real neighbours, and rows are read in order down to the region's last one. A file cut
   short below the region is refused (its end-of-image marker is looked for).

   Built by setup.py as an optional extension (gcc or clang, and libjpeg-turbo's headers:
   Debian's libjpeg-dev); hpclb.data.transforms uses it where it was built. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

#define RIGHT_MARGIN 32 /* decoded columns right of the region: at least one iMCU at any scale */
#define MIN_WIDTH 64    /* decoded columns at the right edge, at least: two iMCUs of 4:1:1 */
#define UPSAMPLING_MARGIN 2 /* chroma samples decoded beside a box read by its restart markers */

struct error_manager {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct error_manager *err = (struct error_manager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* libjpeg's warnings (corrupt or truncated data) end the decode too, as simplejpeg's strict
   mode does: the caller hands such a file to PIL, which decodes or rejects it. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) on_error(cinfo);
}

enum status { OK, LIBJPEG_ERROR, COLOUR_SPACE, BOX_OUTSIDE, TRUNCATED, NO_MEMORY };

static PyObject *raise_for(enum status status, const char *message) {
    switch (status) {
    case LIBJPEG_ERROR:
        PyErr_Format(PyExc_ValueError, "JPEG: %s", message);
        break;
    case COLOUR_SPACE:
        PyErr_SetString(PyExc_ValueError, "a JPEG other than YCbCr or grey");
        break;
    case TRUNCATED:
        PyErr_SetString(PyExc_ValueError, "JPEG: no end-of-image marker after the region (a "
                        "truncated file)");
        break;
    case BOX_OUTSIDE:
        PyErr_SetString(PyExc_ValueError, "decode_region: the box is not inside the decoded image");
        break;
    default:
        PyErr_NoMemory();
    }
    return NULL;
}

static void init_errors(struct jpeg_decompress_struct *cinfo, struct error_manager *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->message[0] = '\0';
}

static int decodable(const struct jpeg_decompress_struct *cinfo) {
    return cinfo->jpeg_color_space == JCS_YCbCr || cinfo->jpeg_color_space == JCS_GRAYSCALE;
}

static PyObject *image_size(PyObject *self, PyObject *args) {
    Py_buffer src;
    struct jpeg_decompress_struct cinfo;
    struct error_manager err;
    volatile enum status status = OK;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    init_errors(&cinfo, &err);
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jump)) {
        status = LIBJPEG_ERROR;
    } else {
        jpeg_mem_src(&cinfo, (const unsigned char *)src.buf, (unsigned long)src.len);
        jpeg_read_header(&cinfo, TRUE);
        if (!decodable(&cinfo)) status = COLOUR_SPACE;
    }
    const long width = (long)cinfo.image_width, height = (long)cinfo.image_height;
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&src);
    if (status != OK) return raise_for(status, err.message);
    return Py_BuildValue("(ll)", width, height);
}

/* The sampling layouts whose column cropping libjpeg-turbo gets right: grey, 4:4:4, 4:2:2,
   4:2:0, 4:4:0 and 4:1:1 (luma h x v of 1x1, 2x1, 2x2, 1x2, 4x1; chroma 1x1). Others (4x2,
   2x4, ...: jpeg_crop_scanline in libjpeg-turbo 2.1 returns wrong pixels for them) are
   decoded at full width, still stopping below the region. */
static int columns_croppable(const struct jpeg_decompress_struct *cinfo) {
    for (int i = 1; i < cinfo->num_components; i++)
        if (cinfo->comp_info[i].h_samp_factor != 1 || cinfo->comp_info[i].v_samp_factor != 1)
            return 0;
    const int h = cinfo->comp_info[0].h_samp_factor, v = cinfo->comp_info[0].v_samp_factor;
    return (v == 1 && (h == 1 || h == 2 || h == 4)) || (v == 2 && (h == 1 || h == 2));
}

/* 0xFF 0xD9 (end of image) in the len bytes at p. Entropy-coded data cannot hold it (an 0xFF
   there is followed by 0x00 or a restart marker). */
static int has_end_marker(const unsigned char *p, size_t len) {
    const unsigned char *end = p + len, *q = p;
    while (q + 1 < end && (q = memchr(q, 0xFF, (size_t)(end - q - 1))) != NULL) {
        if (q[1] == 0xD9) return 1;
        q++;
    }
    return 0;
}

/* ---- Random access through restart markers ----
   A sequential Huffman JPEG (SOF0/SOF1) in one scan, with a restart marker every `interval`
   MCUs and `interval` dividing an MCU row (add_restart_markers writes one after every MCU):
   each restart segment decodes on its own (the DC predictions restart from zero), so the
   header, its frame size set to a rectangle of whole MCUs, and that rectangle's segments with
   their markers renumbered are a JPEG of the rectangle alone, whose pixels are those of the
   whole image where the upsampling of chroma reads no neighbour outside it: a margin of at
   least two chroma samples on every side (inside the image) is decoded and cut off. Only the
   region's MCUs (whole segments of them) are then Huffman-decoded, not every row above it
   and every column beside it. */

struct layout {
    size_t sof;     /* offset of the frame header's height field (then the width's) */
    size_t scan;    /* offset of the first entropy-coded byte */
    unsigned width, height, mcu_width, mcu_height, mcus_per_row, mcu_rows, interval;
    size_t segments;
    size_t *bounds; /* [2 * segments]: each segment's first byte and its end (its marker's) */
};

static unsigned be16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

/* The layout of the n bytes at p (malloc'ed bounds; free them), or 0 where the file is not
   such a JPEG (or not a well-formed one: the decode then goes the general way). */
static int restart_layout(const unsigned char *p, size_t n, struct layout *L) {
    size_t i = 2;
    unsigned components = 0, hmax = 1, vmax = 1, interval = 0;
    L->bounds = NULL;
    L->sof = 0;
    if (n < 4 || p[0] != 0xFF || p[1] != 0xD8) return 0;
    for (;;) { /* the segments up to and including the start of scan */
        if (i >= n || p[i] != 0xFF) return 0;
        while (i < n && p[i] == 0xFF) i++; /* fill bytes */
        if (i + 3 > n) return 0;
        const unsigned marker = p[i++];
        const size_t length = be16(p + i);
        if (length < 2 || i + length > n) return 0;
        const unsigned char *seg = p + i + 2;
        const size_t seg_length = length - 2;
        if (marker == 0xC0 || marker == 0xC1) { /* baseline, extended sequential (Huffman) */
            if (L->sof != 0 || seg_length < 6 || seg[0] != 8) return 0;
            L->height = be16(seg + 1);
            L->width = be16(seg + 3);
            components = seg[5];
            if ((components != 1 && components != 3) || seg_length < 6 + 3 * (size_t)components)
                return 0;
            for (unsigned c = 0; c < components; c++) {
                const unsigned h = seg[7 + 3 * c] >> 4, v = seg[7 + 3 * c] & 15;
                if (h < 1 || h > 4 || v < 1 || v > 4) return 0;
                if (h > hmax) hmax = h;
                if (v > vmax) vmax = v;
            }
            L->sof = i + 3;
        } else if ((marker >= 0xC2 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 &&
                    marker != 0xCC) || marker == 0xDC || marker == 0xD8 || marker == 0xD9 ||
                   (marker >= 0xD0 && marker <= 0xD7)) {
            return 0; /* progressive, lossless or arithmetic coding; DNL; misplaced markers */
        } else if (marker == 0xDD) {
            if (seg_length != 2) return 0;
            interval = be16(seg);
        } else if (marker == 0xDA) {
            if (L->sof == 0 || seg_length < 1 || seg[0] != components) return 0;
            L->scan = i + length;
            break;
        }
        i += length;
    }
    if (interval == 0 || L->width == 0 || L->height == 0) return 0;
    L->mcu_width = components == 1 ? 8 : 8 * hmax;
    L->mcu_height = components == 1 ? 8 : 8 * vmax;
    L->mcus_per_row = (L->width + L->mcu_width - 1) / L->mcu_width;
    L->mcu_rows = (L->height + L->mcu_height - 1) / L->mcu_height;
    L->interval = interval;
    if (L->mcus_per_row % interval != 0) return 0;
    L->segments = (size_t)L->mcus_per_row * L->mcu_rows / interval;
    if (L->segments > n / 3) return 0; /* a segment is at least a byte and its marker */
    L->bounds = malloc(2 * L->segments * sizeof(size_t));
    if (L->bounds == NULL) return 0;
    size_t k = 0, q = L->scan;
    L->bounds[0] = q;
    for (;;) { /* every segment's bounds, by its marker: RST0, RST1, ... RST7, RST0, ..., EOI */
        const unsigned char *f = q < n ? memchr(p + q, 0xFF, n - q) : NULL;
        if (f == NULL) break; /* no end-of-image marker: truncated */
        size_t j = (size_t)(f - p);
        const size_t end = j;
        while (j + 1 < n && p[j + 1] == 0xFF) j++;
        if (j + 1 >= n) break;
        const unsigned code = p[j + 1];
        q = j + 2;
        if (code == 0x00) continue; /* a stuffed 0xFF byte of the data */
        if (code == 0xD9 || (code >= 0xD0 && code <= 0xD7)) {
            L->bounds[2 * k + 1] = end;
            if (++k == L->segments) {
                if (code == 0xD9) return 1;
                break;
            }
            if (code != 0xD0 + ((k - 1) & 7)) break;
            L->bounds[2 * k] = q;
            continue;
        }
        break; /* another marker: a second scan, DNL, ... */
    }
    free(L->bounds);
    L->bounds = NULL;
    return 0;
}

/* The JPEG of MCU columns [c0, c1) and rows [r0, r1) (c0, c1 multiples of the interval or the
   row's end) of the file at p: malloc'ed, its size in *size; NULL where out of memory. */
static unsigned char *rectangle_jpeg(const unsigned char *p, const struct layout *L,
                                     size_t c0, size_t c1, size_t r0, size_t r1, size_t *size) {
    const size_t first = c0 / L->interval, last = (c1 + L->interval - 1) / L->interval;
    const size_t per_row = L->mcus_per_row / L->interval;
    size_t total = L->scan + 2;
    for (size_t r = r0; r < r1; r++)
        for (size_t k = r * per_row + first; k < r * per_row + last; k++)
            total += L->bounds[2 * k + 1] - L->bounds[2 * k] + 2;
    unsigned char *out = malloc(total), *o = out;
    if (out == NULL) return NULL;
    memcpy(o, p, L->scan);
    const size_t right = (size_t)L->mcu_width * c1 < L->width ? (size_t)L->mcu_width * c1
                                                               : L->width;
    const size_t bottom = (size_t)L->mcu_height * r1 < L->height ? (size_t)L->mcu_height * r1
                                                                  : L->height;
    const size_t height = bottom - (size_t)L->mcu_height * r0;
    const size_t width = right - (size_t)L->mcu_width * c0;
    o[L->sof] = (unsigned char)(height >> 8);
    o[L->sof + 1] = (unsigned char)height;
    o[L->sof + 2] = (unsigned char)(width >> 8);
    o[L->sof + 3] = (unsigned char)width;
    o += L->scan;
    unsigned restart = 0;
    for (size_t r = r0; r < r1; r++) {
        for (size_t k = r * per_row + first; k < r * per_row + last; k++) {
            const size_t length = L->bounds[2 * k + 1] - L->bounds[2 * k];
            memcpy(o, p + L->bounds[2 * k], length);
            o += length;
            *o++ = 0xFF;
            *o++ = (unsigned char)(0xD0 + (restart++ & 7));
        }
    }
    o[-1] = 0xD9; /* the last segment's marker: end of image */
    *size = total - 2;
    return out;
}

/* Rows [y0, y1) and columns [x0, x1) of the image cinfo (header read, output size set) into
   dst ((y1 - y0) rows of (x1 - x0) x 3 bytes); columns cropped when crop_columns (a margin
   beside the box, as the header comment says). With check_end, a file whose end-of-image
   marker is not found below the box is refused. */
static enum status read_box(struct jpeg_decompress_struct *cinfo, struct error_manager *err,
                            int x0, int y0, int x1, int y1, unsigned char *dst,
                            int crop_columns, int check_end) {
    const size_t box_width = (size_t)(x1 - x0), box_height = (size_t)(y1 - y0);
    unsigned char *volatile row = NULL;
    volatile enum status status = OK;
    if (setjmp(err->jump)) {
        status = LIBJPEG_ERROR;
    } else {
        jpeg_start_decompress(cinfo);
        const JDIMENSION image_width = cinfo->output_width;
        JDIMENSION left = 0, width = image_width;
        if (crop_columns && columns_croppable(cinfo)) {
            /* one pixel left of the box and RIGHT_MARGIN right of it (the fancy upsampling
               of the box's edge columns reads their neighbours); the last MIN_WIDTH columns
               at least where it reaches the right edge (a crop of one chroma sample there
               would be upsampled differently) */
            left = x0 > 0 ? (JDIMENSION)x0 - 1 : 0;
            if (left + MIN_WIDTH > image_width)
                left = image_width > MIN_WIDTH ? image_width - MIN_WIDTH : 0;
            width = (JDIMENSION)x1 + RIGHT_MARGIN - left;
            if (left + width > image_width) width = image_width - left;
            jpeg_crop_scanline(cinfo, &left, &width); /* left: down to an iMCU's edge */
        }
        row = malloc((size_t)width * 3);
        if (row == NULL) {
            status = NO_MEMORY;
        } else {
            JSAMPROW rows[1] = {row};
            const size_t offset = ((size_t)x0 - left) * 3;
            if (y0 > 0) jpeg_skip_scanlines(cinfo, (JDIMENSION)y0);
            for (size_t y = 0; y < box_height; y++) {
                jpeg_read_scanlines(cinfo, rows, 1);
                memcpy(dst + y * box_width * 3, row + offset, box_width * 3);
            }
            /* The rows below the box are not decoded, so a file cut short there would pass:
               it must still end with its end-of-image marker (read already, or in the bytes
               not read yet), as a whole-image decode checks. */
            if (check_end && !jpeg_input_complete(cinfo) && cinfo->unread_marker != 0xD9 &&
                !has_end_marker(cinfo->src->next_input_byte, cinfo->src->bytes_in_buffer))
                status = TRUNCATED;
        }
    }
    free(row);
    return status;
}

/* The box of a file with restart markers (restart_layout): the JPEG of the MCUs under the box
   widened by UPSAMPLING_MARGIN chroma samples' width on every side (inside the image), decoded
   whole at the scale. Fancy upsampling computes an output pixel from its chroma sample and
   that sample's neighbour, so the box's pixels read only samples of this JPEG, and those are
   the whole image's (the IDCT of a block reads that block alone); the margin also keeps the
   rectangle over 2 chroma samples wide unless it is the whole image's width (libjpeg-turbo
   upsamples a narrower component without smoothing). */
static enum status read_box_by_restarts(const unsigned char *p, const struct layout *L,
                                        int scale, int x0, int y0, int x1, int y1,
                                        unsigned char *dst, char *message) {
    const size_t mw = L->mcu_width, mh = L->mcu_height, s = (size_t)scale;
    /* a chroma sample's width and height in pixels at the scale: at most mw / 8 and mh / 8 at
       every scale, since libjpeg-turbo scales chroma up by its IDCT only where the sampling
       allows (4:2:0 at 1/2: one pixel) and upsamples it otherwise (4:2:2 at 1/2: two) */
    const size_t mx = UPSAMPLING_MARGIN * (mw / 8), my = UPSAMPLING_MARGIN * (mh / 8);
    size_t c0 = ((size_t)x0 > mx ? (size_t)x0 - mx : 0) * s / mw;
    size_t r0 = ((size_t)y0 > my ? (size_t)y0 - my : 0) * s / mh;
    size_t c1 = (((size_t)x1 + mx) * s + mw - 1) / mw, r1 = (((size_t)y1 + my) * s + mh - 1) / mh;
    c0 = c0 / L->interval * L->interval;
    c1 = (c1 + L->interval - 1) / L->interval * L->interval;
    if (c1 > L->mcus_per_row) c1 = L->mcus_per_row;
    if (r1 > L->mcu_rows) r1 = L->mcu_rows;
    size_t size;
    unsigned char *jpeg = rectangle_jpeg(p, L, c0, c1, r0, r1, &size);
    if (jpeg == NULL) return NO_MEMORY;
    struct jpeg_decompress_struct cinfo;
    struct error_manager err;
    enum status status = OK;
    init_errors(&cinfo, &err);
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jump)) {
        status = LIBJPEG_ERROR;
    } else {
        jpeg_mem_src(&cinfo, jpeg, (unsigned long)size);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = 1;
        cinfo.scale_denom = (unsigned int)scale;
        cinfo.dct_method = JDCT_ISLOW;
        cinfo.do_fancy_upsampling = TRUE;
        const int dx = (int)(c0 * mw / s), dy = (int)(r0 * mh / s);
        status = read_box(&cinfo, &err, x0 - dx, y0 - dy, x1 - dx, y1 - dy, dst, 0, 0);
    }
    if (status == LIBJPEG_ERROR) memcpy(message, err.message, JMSG_LENGTH_MAX);
    jpeg_destroy_decompress(&cinfo);
    free(jpeg);
    return status;
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer src;
    int scale, x0, y0, x1, y1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*i(iiii)", &src, &scale, &x0, &y0, &x1, &y1)) return NULL;
    if (x0 < 0 || y0 < 0 || x1 <= x0 || y1 <= y0 ||
        (scale != 1 && scale != 2 && scale != 4 && scale != 8)) {
        PyBuffer_Release(&src);
        PyErr_Format(PyExc_ValueError, "decode_region: scale %d, box (%d, %d, %d, %d): the scale "
                     "must be 1, 2, 4 or 8 and the box non-empty", scale, x0, y0, x1, y1);
        return NULL;
    }
    const size_t box_width = (size_t)(x1 - x0), box_height = (size_t)(y1 - y0);
    struct jpeg_decompress_struct cinfo;
    struct error_manager err;
    volatile enum status status = OK;
    PyObject *out = NULL;
    init_errors(&cinfo, &err);
    jpeg_create_decompress(&cinfo);
    /* The header, the output size and the box's check, with the GIL (no allocation for a box
       that is not inside the image) */
    if (setjmp(err.jump)) {
        status = LIBJPEG_ERROR;
    } else {
        jpeg_mem_src(&cinfo, (const unsigned char *)src.buf, (unsigned long)src.len);
        jpeg_read_header(&cinfo, TRUE);
        if (!decodable(&cinfo)) {
            status = COLOUR_SPACE;
        } else {
            cinfo.out_color_space = JCS_RGB;
            cinfo.scale_num = 1;
            cinfo.scale_denom = (unsigned int)scale;
            cinfo.dct_method = JDCT_ISLOW;
            cinfo.do_fancy_upsampling = TRUE;
            jpeg_calc_output_dimensions(&cinfo);
            if ((JDIMENSION)x1 > cinfo.output_width || (JDIMENSION)y1 > cinfo.output_height)
                status = BOX_OUTSIDE;
        }
    }
    if (status == OK) {
        out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(box_width * box_height * 3));
        if (out == NULL) {
            jpeg_destroy_decompress(&cinfo);
            PyBuffer_Release(&src);
            return NULL;
        }
    }
    unsigned char *dst = out == NULL ? NULL : (unsigned char *)PyByteArray_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    if (status == OK) {
        struct layout layout;
        if (restart_layout((const unsigned char *)src.buf, (size_t)src.len, &layout)) {
            status = read_box_by_restarts((const unsigned char *)src.buf, &layout, scale, x0, y0,
                                          x1, y1, dst, err.message);
            free(layout.bounds);
        } else {
            status = read_box(&cinfo, &err, x0, y0, x1, y1, dst, 1, 1);
        }
    }
    jpeg_destroy_decompress(&cinfo); /* also ends a decode stopped above the image's bottom */
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (status == OK) return out;
    Py_XDECREF(out);
    return raise_for(status, err.message);
}

/* A copy of a JPEG with a restart marker after every MCU, the same pixels (its DCT
   coefficients are copied, not re-encoded: jpegtran -restart 1B -copy all), sequential
   Huffman coding with optimised tables; the APPn and COM segments are kept. */
static PyObject *add_restart_markers(PyObject *self, PyObject *args) {
    Py_buffer src;
    int interval = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*|i", &src, &interval)) return NULL;
    if (interval < 1 || interval > 65535) {
        PyBuffer_Release(&src);
        PyErr_Format(PyExc_ValueError, "add_restart_markers: interval %d: must be 1 to 65535 "
                     "MCUs", interval);
        return NULL;
    }
    struct jpeg_decompress_struct din;
    struct jpeg_compress_struct cout;
    struct error_manager err;
    volatile enum status status = OK;
    unsigned char *buffer = NULL;
    unsigned long size = 0;
    init_errors(&din, &err);
    cout.err = din.err;
    jpeg_create_decompress(&din);
    jpeg_create_compress(&cout);
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump)) {
        status = LIBJPEG_ERROR;
    } else {
        jpeg_mem_src(&din, (const unsigned char *)src.buf, (unsigned long)src.len);
        for (int m = 0; m < 16; m++) jpeg_save_markers(&din, JPEG_APP0 + m, 0xFFFF);
        jpeg_save_markers(&din, JPEG_COM, 0xFFFF);
        jpeg_read_header(&din, TRUE);
        if (!decodable(&din)) {
            status = COLOUR_SPACE;
        } else {
            jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&din);
            jpeg_copy_critical_parameters(&din, &cout);
            cout.restart_interval = (unsigned int)interval;
            cout.optimize_coding = TRUE;
            jpeg_mem_dest(&cout, &buffer, &size);
            jpeg_write_coefficients(&cout, coefficients);
            for (jpeg_saved_marker_ptr m = din.marker_list; m != NULL; m = m->next) {
                if (cout.write_JFIF_header && m->marker == JPEG_APP0 && m->data_length >= 5 &&
                    memcmp(m->data, "JFIF", 5) == 0)
                    continue; /* written already */
                if (cout.write_Adobe_marker && m->marker == JPEG_APP0 + 14 &&
                    m->data_length >= 5 && memcmp(m->data, "Adobe", 5) == 0)
                    continue;
                jpeg_write_marker(&cout, m->marker, m->data, m->data_length);
            }
            jpeg_finish_compress(&cout);
            jpeg_finish_decompress(&din);
        }
    }
    jpeg_destroy_compress(&cout);
    jpeg_destroy_decompress(&din);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyObject *out = status == OK
        ? PyBytes_FromStringAndSize((const char *)buffer, (Py_ssize_t)size) : NULL;
    free(buffer);
    if (status != OK) return raise_for(status, err.message);
    return out;
}

static PyObject *restart_interval(PyObject *self, PyObject *args) {
    Py_buffer src;
    struct layout layout;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = restart_layout((const unsigned char *)src.buf, (size_t)src.len, &layout);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    free(layout.bounds);
    return PyLong_FromUnsignedLong(found ? layout.interval : 0);
}

static PyMethodDef methods[] = {
    {"image_size", image_size, METH_VARARGS,
     "image_size(data) -> (width, height): the JPEG's size in pixels, from its header. Raises "
     "ValueError for a JPEG libjpeg cannot read or one other than YCbCr or grey (CMYK)."},
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, scale, (x0, y0, x1, y1)) -> bytearray: the pixels of the box (left, "
     "top, right, bottom; pixels of the image decoded at 1/scale, scale 1, 2, 4 or 8), RGB "
     "uint8, (y1 - y0) rows of (x1 - x0) x 3 bytes. The GIL is released while it decodes. "
     "Raises ValueError for corrupt or truncated data, a colour space other than YCbCr or "
     "grey, or a box not inside the decoded image."},
    {"restart_interval", restart_interval, METH_VARARGS,
     "restart_interval(data) -> int: the MCUs between restart markers where decode_region "
     "enters the JPEG at a region's MCUs (a sequential Huffman JPEG in one scan, the interval "
     "dividing an MCU row, every marker in place down to the end of image), else 0."},
    {"add_restart_markers", add_restart_markers, METH_VARARGS,
     "add_restart_markers(data, interval=1) -> bytes: the JPEG with a restart marker after "
     "every interval MCUs, "
     "losslessly (its DCT coefficients copied: the same pixels), sequential Huffman coding, "
     "APPn and COM segments kept; decode_region then decodes only a region's MCUs. Raises "
     "ValueError for a JPEG libjpeg cannot read or one other than YCbCr or grey."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg_region",
    "Decode a region of a JPEG at a DCT scale (libjpeg-turbo); see hpclb.data.transforms.",
    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jpeg_region(void) {
    PyObject *m = PyModule_Create(&module);
#ifdef LIBJPEG_TURBO_VERSION_NUMBER /* the headers' libjpeg-turbo, e.g. 2001005: 2.1.5 */
    if (m != NULL &&
        PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION", LIBJPEG_TURBO_VERSION_NUMBER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
