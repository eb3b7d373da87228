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
    unsigned char *volatile row = NULL;
    PyObject *volatile out = NULL;
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
        if (setjmp(err.jump)) {
            status = LIBJPEG_ERROR;
        } else {
            jpeg_start_decompress(&cinfo);
            const JDIMENSION image_width = cinfo.output_width;
            JDIMENSION left = 0, width = image_width;
            if (columns_croppable(&cinfo)) {
                /* one pixel left of the box and RIGHT_MARGIN right of it (the fancy upsampling
                   of the box's edge columns reads their neighbours); the last MIN_WIDTH columns
                   at least where it reaches the right edge (a crop of one chroma sample there
                   would be upsampled differently) */
                left = x0 > 0 ? (JDIMENSION)x0 - 1 : 0;
                if (left + MIN_WIDTH > image_width)
                    left = image_width > MIN_WIDTH ? image_width - MIN_WIDTH : 0;
                width = (JDIMENSION)x1 + RIGHT_MARGIN - left;
                if (left + width > image_width) width = image_width - left;
                jpeg_crop_scanline(&cinfo, &left, &width); /* left: down to an iMCU's edge */
            }
            row = malloc((size_t)width * 3);
            if (row == NULL) {
                status = NO_MEMORY;
            } else {
                JSAMPROW rows[1] = {row};
                const size_t offset = ((size_t)x0 - left) * 3;
                if (y0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0);
                for (size_t y = 0; y < box_height; y++) {
                    jpeg_read_scanlines(&cinfo, rows, 1);
                    memcpy(dst + y * box_width * 3, row + offset, box_width * 3);
                }
                /* The rows below the box are not decoded, so a file cut short there would
                   pass: it must still end with its end-of-image marker (read already, or in
                   the bytes not read yet), as a whole-image decode checks. */
                if (!jpeg_input_complete(&cinfo) && cinfo.unread_marker != 0xD9 &&
                    !has_end_marker(cinfo.src->next_input_byte, cinfo.src->bytes_in_buffer))
                    status = TRUNCATED;
            }
        }
    }
    free(row);
    jpeg_destroy_decompress(&cinfo); /* also ends a decode stopped above the image's bottom */
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (status == OK) return out;
    Py_XDECREF(out);
    return raise_for(status, err.message);
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
