package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.ObjectMapper;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.util.List;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/** A reader opens only disk segment files below its node's spill dirs' data directories. */
class LocalSegmentFilesTest {
  private static final byte[] SECRET = "not a shuffle segment".getBytes(StandardCharsets.UTF_8);
  private static final byte[] SEGMENT = "rows of partition 3".getBytes(StandardCharsets.UTF_8);

  @TempDir Path tmp;
  private Path spill;
  private Path segment;
  private Path outside;
  private List<String> spillDirs;

  @BeforeEach
  void layout() throws Exception {
    spill = Files.createDirectories(tmp.resolve("spill"));
    segment = RaySegmentSink.segmentPath(spill.toString(), "spark-app-1-0", 2, 42L, 3, 0);
    Files.createDirectories(segment.getParent());
    Files.write(segment, SEGMENT);
    outside = tmp.resolve("elsewhere").resolve("secret.seg");
    Files.createDirectories(outside.getParent());
    Files.write(outside, SECRET);
    spillDirs = List.of(spill.toString());
  }

  private void assertRefused(String location) {
    var e = assertThrows(LocalSegmentFiles.UnsafeSegmentPathException.class,
        () -> LocalSegmentFiles.read(location, spillDirs));
    assertTrue(e.getMessage().contains(location), e.getMessage());
    assertTrue(e.getMessage().contains(spill.resolve("hybrid_ray").toString()), e.getMessage());
  }

  @Test
  void aSegmentInsideTheSpillDirIsRead() throws Exception {
    assertArrayEquals(SEGMENT, LocalSegmentFiles.read(segment.toString(), spillDirs));
  }

  @Test
  void aSpillDirThatIsASymlinkIsFollowed() throws Exception {
    Path link = Files.createSymbolicLink(tmp.resolve("spill-link"), spill);
    Path viaLink = RaySegmentSink.segmentPath(link.toString(), "spark-app-1-0", 2, 42L, 3, 0);
    assertArrayEquals(SEGMENT,
        LocalSegmentFiles.read(viaLink.toString(), List.of(link.toString())));
  }

  @Test
  void aPathOutsideEverySpillDirIsRefused() {
    assertRefused(outside.toString());
    // The spill dir itself, but not its data directory, is not enough.
    assertRefused(spill.resolve("loose.seg").toString());
  }

  @Test
  void aDotDotEscapeIsRefused() {
    String escape = spill.resolve("hybrid_ray").resolve("spark-app-1-0").resolve("..")
        .resolve("..").resolve("..").resolve("elsewhere").resolve("secret.seg").toString();
    assertTrue(Files.exists(Path.of(escape)), "the escape must name a real file");
    assertRefused(escape);
  }

  @Test
  void aSymlinkEscapeIsRefused() throws Exception {
    // A segment file that is a symlink to a file outside ...
    Path fileLink = segment.resolveSibling("m00002-a00000000000000000043-s00000.seg");
    Files.createSymbolicLink(fileLink, outside);
    assertRefused(fileLink.toString());
    // ... and a shuffle directory that is a symlink to a directory outside.
    Path dirLink = spill.resolve("hybrid_ray").resolve("spark-app-1-9");
    Files.createSymbolicLink(dirLink, outside.getParent());
    assertRefused(dirLink.resolve("secret.seg").toString());
  }

  @Test
  void aRelativePathIsRefused() {
    assertRefused("hybrid_ray/spark-app-1-0/sub-00003/x.seg");
  }

  @Test
  void aMissingSegmentIsGoneNotUnsafe() {
    String gone = segment.resolveSibling("never-written.seg").toString();
    assertThrows(NoSuchFileException.class, () -> LocalSegmentFiles.read(gone, spillDirs));
  }

  @Test
  void spillDirsComeFromTheConfigWithTheNodeIdExpanded() throws Exception {
    var config = new ObjectMapper().readTree(
        "{\"spill_dirs\": [\"/mnt/a\", \"/mnt/{node_id}/b\"], \"namespace\": \"x\"}");
    assertEquals(List.of("/mnt/a", "/mnt/n1/b"), LocalSegmentFiles.spillDirs(config, "n1"));
    var none = new ObjectMapper().readTree("{}");
    assertEquals(List.of(LocalSegmentFiles.defaultSpillDir()),
        LocalSegmentFiles.spillDirs(none, "n1"));
  }
}
