/* A small program linked against Darknet's own objects (AlexeyAB/darknet, built for the CPU),
 * so that tests can ask Darknet itself what it computes. Built by tests/darknet_ref/build.py.
 *
 *   harness yolo CFG BATCH TRUTHS.txt LAYER INPUT.f32 DELTA.f32 COST.txt [LAYER ...]
 *       forward_yolo_layer, in training mode, of each [yolo] layer LAYER (Darknet's index, from
 *       0) of the network parsed at BATCH images, on INPUT (float32, batch x channels x h x w:
 *       the output of the layer below); TRUTHS lines are "image x y w h class" (normalized).
 *       Writes l.delta (same layout) and *l.cost of each.
 *   harness lr CFG N [SEED]
 *       N lines: get_current_rate() at *net.seen = k * batch * subdivisions, k = 0..N-1
 *       (srand(SEED) first, for policy=random).
 *   harness update CFG IN.weights INPUT.f32 TRUTHS.txt N OUT.weights
 *       N calls of train_network (each: subdivisions calls of train_network_datum on the
 *       mini-batches of INPUT, which holds batch = mini-batch x subdivisions images, then
 *       update_network and the EMA), starting from IN.weights (its seen sets the iteration);
 *       TRUTHS image indices count over the whole batch. Writes the weights after the last.
 *   harness loader IMAGE W H JITTER RESIZE LETTER_BOX FLIP CLASSES MAX SEED TRUTHS.f32
 *                  [PIXELS.f32 HUE SATURATION EXPOSURE]
 *       srand(SEED), then Darknet's load_data_detection (the build without OpenCV) of IMAGE
 *       (its labels beside it, .txt) for a W x H network: hue 0, saturation and exposure 1
 *       unless given, no mixup, blur or noise. Writes the MAX x 6 truth floats it makes, and
 *       with PIXELS the network input (3 x H x W floats, RGB in [0, 1]).
 *
 * Everything Darknet prints goes to stdout/stderr; results go to the files named.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "darknet.h"
#include "data.h"
#include "list.h"
#include "network.h"
#include "option_list.h"
#include "parser.h"
#include "yolo_layer.h"

typedef struct {
    char *type;
    list *options;
} section; /* as parser.c declares it */

list *read_cfg(char *filename);
void parse_net_options(list *options, network *net);

static float *read_floats(const char *path, size_t *count)
{
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", path); exit(2); }
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    *count = (size_t)bytes / sizeof(float);
    float *x = (float *)malloc(bytes > 0 ? bytes : 1);
    if (*count && fread(x, sizeof(float), *count, f) != *count) {
        fprintf(stderr, "short read %s\n", path);
        exit(2);
    }
    fclose(f);
    return x;
}

static void write_floats(const char *path, const float *x, size_t count)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(x, sizeof(float), count, f) != count) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(2);
    }
    fclose(f);
}

/* Truths as Darknet's loader lays them out: per image `max_boxes` boxes of `truth_size` floats
 * (x, y, w, h, class, track id), zero after the last box. */
static float *read_truths(const char *path, int images, int max_boxes, int truth_size)
{
    float *truth = (float *)calloc((size_t)images * max_boxes * truth_size, sizeof(float));
    int *count = (int *)calloc(images, sizeof(int));
    FILE *f = fopen(path, "r");
    if (!f) { fprintf(stderr, "cannot open %s\n", path); exit(2); }
    int image;
    float x, y, w, h, cls;
    while (fscanf(f, "%d %f %f %f %f %f", &image, &x, &y, &w, &h, &cls) == 6) {
        if (image < 0 || image >= images) { fprintf(stderr, "image %d out of range\n", image); exit(2); }
        if (count[image] >= max_boxes) continue;
        float *t = truth + ((size_t)image * max_boxes + count[image]) * truth_size;
        t[0] = x; t[1] = y; t[2] = w; t[3] = h; t[4] = cls;
        count[image]++;
    }
    fclose(f);
    free(count);
    return truth;
}

static int run_yolo(int argc, char **argv)
{
    if (argc < 9 || (argc - 5) % 4) {
        fprintf(stderr, "usage: yolo CFG BATCH TRUTHS LAYER INPUT DELTA COST [LAYER INPUT DELTA COST ...]\n");
        return 2;
    }
    int batch = atoi(argv[3]);
    network net = parse_network_cfg_custom(argv[2], batch, 1);
    for (int a = 5; a < argc; a += 4) {
        int index = atoi(argv[a]);
        if (index < 0 || index >= net.n || net.layers[index].type != YOLO) {
            fprintf(stderr, "layer %d is not a [yolo] layer\n", index);
            return 2;
        }
        layer l = net.layers[index];
        size_t n;
        float *x = read_floats(argv[a + 1], &n);
        if (n != (size_t)l.batch * l.inputs) {
            fprintf(stderr, "%s holds %zu floats, layer %d needs %d\n", argv[a + 1], n, index, l.batch * l.inputs);
            return 2;
        }
        float *truth = read_truths(argv[4], batch, l.max_boxes, l.truth_size);
        network_state state = {0};
        state.net = net;
        state.index = index;
        state.input = x;
        state.truth = truth;
        state.train = 1;
        forward_yolo_layer(l, state);
        write_floats(argv[a + 2], l.delta, (size_t)l.batch * l.outputs);
        FILE *f = fopen(argv[a + 3], "w");
        fprintf(f, "%.9g\n", *l.cost);
        fclose(f);
        free(x);
        free(truth);
    }
    return 0;
}

static int run_lr(int argc, char **argv)
{
    if (argc != 4 && argc != 5) { fprintf(stderr, "usage: lr CFG N [SEED]\n"); return 2; }
    list *sections = read_cfg(argv[2]);
    section *s = (section *)sections->front->val;
    network net = make_network(sections->size - 1);
    parse_net_options(s->options, &net);
    int iterations = atoi(argv[3]);
    if (argc == 5) srand(atoi(argv[4]));
    for (int k = 0; k < iterations; ++k) {
        *net.seen = (uint64_t)k * net.batch * net.subdivisions;
        printf("%.9g\n", get_current_rate(net));
    }
    return 0;
}

static int run_update(int argc, char **argv)
{
    if (argc != 8) { fprintf(stderr, "usage: update CFG IN.weights INPUT TRUTHS N OUT.weights\n"); return 2; }
    network net = parse_network_cfg_custom(argv[2], 0, 0);
    load_weights(&net, argv[3]);
    size_t n;
    float *x = read_floats(argv[4], &n);
    int images = net.batch * net.subdivisions;
    if (n != (size_t)images * net.inputs) { fprintf(stderr, "input holds %zu floats, expected %d\n", n, images * net.inputs); return 2; }
    layer last = net.layers[net.n - 1];
    int truths = last.truths; /* every [yolo] layer of the test cfgs has the same max */
    float *truth = read_truths(argv[5], images, last.max_boxes, last.truth_size);
    int iterations = atoi(argv[6]);
    /* One iteration is Darknet's train_network on a batch: subdivisions passes, the update, the
     * EMA of ema_alpha. */
    data d = {0};
    d.X.rows = d.y.rows = images;
    d.X.cols = net.inputs;
    d.y.cols = truths;
    d.X.vals = (float **)calloc(images, sizeof(float *));
    d.y.vals = (float **)calloc(images, sizeof(float *));
    for (int i = 0; i < images; ++i) {
        d.X.vals[i] = x + (size_t)i * net.inputs;
        d.y.vals[i] = truth + (size_t)i * truths;
    }
    for (int it = 0; it < iterations; ++it) train_network(net, d);
    save_weights(net, argv[7]);
    return 0;
}

static int run_loader(int argc, char **argv)
{
    if (argc != 13 && argc != 17) {
        fprintf(stderr, "usage: loader IMAGE W H JITTER RESIZE LETTER_BOX FLIP CLASSES MAX SEED TRUTHS"
            " [PIXELS HUE SATURATION EXPOSURE]\n");
        return 2;
    }
    char *paths[1] = {argv[2]};
    int w = atoi(argv[3]), h = atoi(argv[4]), boxes = atoi(argv[10]);
    float hue = 0, saturation = 1, exposure = 1;
    if (argc == 17) hue = atof(argv[14]), saturation = atof(argv[15]), exposure = atof(argv[16]);
    srand(atoi(argv[11]));
    data d = load_data_detection(1, paths, 1, w, h, 3, boxes, 6, atoi(argv[9]), atoi(argv[8]), 0, 0, 0,
        atof(argv[5]), atof(argv[6]), hue, saturation, exposure, 1, 0, 0, atoi(argv[7]), 0, 0, 0, 0, 0);
    write_floats(argv[12], d.y.vals[0], (size_t)boxes * 6);
    if (argc == 17) write_floats(argv[13], d.X.vals[0], (size_t)w * h * 3);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "loader")) return run_loader(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "yolo")) return run_yolo(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "lr")) return run_lr(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "update")) return run_update(argc, argv);
    fprintf(stderr, "usage: harness yolo|lr|update|loader ...\n");
    return 2;
}
